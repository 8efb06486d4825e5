#include "wire/protocol.hpp"

namespace elasticstore {

const char* op_name(uint8_t op) {
  switch (static_cast<Op>(op)) {
    case Op::Hello: return "HELLO";
    case Op::Set: return "SET";
    case Op::Get: return "GET";
    case Op::TryGet: return "TRY_GET";
    case Op::Add: return "ADD";
    case Op::CompareSet: return "COMPARE_SET";
    case Op::Wait: return "WAIT";
    case Op::Check: return "CHECK";
    case Op::DeleteKey: return "DELETE_KEY";
    case Op::NumKeys: return "NUM_KEYS";
    case Op::ListKeys: return "LIST_KEYS";
    case Op::Append: return "APPEND";
    case Op::MultiGet: return "MULTI_GET";
    case Op::MultiSet: return "MULTI_SET";
    case Op::QueuePush: return "QUEUE_PUSH";
    case Op::QueuePop: return "QUEUE_POP";
    case Op::QueueLen: return "QUEUE_LEN";
    case Op::Ping: return "PING";
    case Op::Barrier: return "BARRIER";
    case Op::Watch: return "WATCH";
    case Op::Stats: return "STATS";
    case Op::Auth: return "AUTH";
    case Op::AllowPeers: return "ALLOW_PEERS";
  }
  return "UNKNOWN";
}

const char* status_name(uint8_t status) {
  switch (static_cast<Status>(status)) {
    case Status::Ok: return "OK";
    case Status::Timeout: return "TIMEOUT";
    case Status::Error: return "ERROR";
    case Status::WrongType: return "WRONG_TYPE";
    case Status::TooLarge: return "TOO_LARGE";
    case Status::Compacted: return "COMPACTED";
    case Status::Unauthenticated: return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

}  // namespace elasticstore
