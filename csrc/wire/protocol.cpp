#include "wire/protocol.hpp"

namespace elasticstore {

const char* op_name(uint8_t op) {
  const OpInfo* info = op_info(op);
  return info ? info->wire_name : "UNKNOWN";
}

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::Session: return "session";
    case OpKind::Auth: return "auth";
    case OpKind::Store: return "store";
    case OpKind::Admin: return "admin";
  }
  return "unknown";
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
