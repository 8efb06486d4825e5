// Codecs turn a connection's bytes into calls on KvState and Completions into reply bytes. The
// native codec lives in codec_native.cpp (one handler per opcode, in a table built from
// wire/ops.def); the TCPStore codec (codec_tcpstore.cpp) implements the same interface over the
// same KvState and waiter machinery.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/kv_state.hpp"
#include "wire/auth.hpp"

namespace elasticstore {

using StatsList = std::vector<std::pair<std::string, uint64_t>>;

class StatsSource {
 public:
  virtual ~StatsSource() = default;
  virtual StatsList stats_snapshot() const = 0;
};

struct CommandContext {
  KvState& kv;
  ConnId conn;
  std::string& out;  // the connection's write buffer: replies are appended here
  const StatsSource& stats;
  ServerAuth& auth;
};

// ReplyAndClose: the request was handled (*consumed) and answered with a refusal; the reply is
// sent, then the connection closes for *reason (a failed handshake).
enum class Step { NeedMore, Handled, Close, ReplyAndClose };

class Codec {
 public:
  virtual ~Codec() = default;
  virtual const char* name() const noexcept = 0;
  // Handles the one request at the front of [data, data + size) if all of it is there.
  // Handled: *consumed bytes are done. Close: *reason says why (logged, then the connection closes).
  virtual Step step(CommandContext& ctx, const char* data, std::size_t size, std::size_t* consumed,
                    std::string* reason) = 0;
  // Encodes a finished blocking request for this codec's peer, reading the values it names from
  // `kv`. The reply's size is known before anything is built: a reply over the protocol's reply
  // limit becomes an error reply, and one that would append more than `room` bytes is not built
  // at all. False: the completion cannot be sent (no room, or the protocol cannot express it);
  // *reason says why and the connection closes.
  virtual bool complete(const Completion& c, const KvState& kv, std::string& out,
                        std::size_t room, std::string* reason) = 0;
  // True once the codec's handshake is done (native: HELLO answered, and AUTH with a token).
  virtual bool handshake_done() const noexcept = 0;
};

// The native codec's reply to a completion (codec_native_replies.cpp); the contract of Codec::complete.
bool encode_native_completion(const Completion& c, const KvState& kv, std::string& out,
                              std::size_t room, std::string* reason);

// The native codec; expects the preamble to have been consumed already.
std::unique_ptr<Codec> make_native_codec();
// torch's TCPStore protocol (codec_tcpstore.cpp); starts at the client's VALIDATE request.
std::unique_ptr<Codec> make_tcpstore_codec();

}  // namespace elasticstore
