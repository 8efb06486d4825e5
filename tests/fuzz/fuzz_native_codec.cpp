// libFuzzer target: the native frame decoder and every opcode's handler, fed as a socket would
// (the first bytes choose how the rest is split), over a real KvState with small limits so that
// the quota and TOO_LARGE paths are reached. Checks: no crash/UB/leak (sanitizers), every close
// has a reason, nothing is stored before HELLO, the quota is never exceeded.
#include "fuzz_common.hpp"
#include "wire/protocol.hpp"

using namespace elasticstore;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::size_t ncuts = size ? data[0] % 8 : 0;
  if (size < 1 + ncuts) return 0;
  const std::string input(reinterpret_cast<const char*>(data) + 1 + ncuts, size - 1 - ncuts);
  StoreLimits lim;
  lim.max_key_bytes = 64;
  lim.max_value_bytes = 4096;
  lim.max_keys_per_request = 16;
  lim.max_waiters_per_connection = 8;
  lim.max_stored_keys = 32;
  lim.max_stored_bytes = 16 * 1024;
  KvState kv([] { return uint64_t{0}; }, lim);
  kv.open_session(1);
  kv.open_session(2);
  auto codec = make_native_codec();
  bool closed = false;
  fuzz::drive(*codec, kv, 1, input, data + 1, ncuts, &closed);
  if (!codec->handshake_done()) FUZZ_ASSERT(kv.num_keys() == 0 && kv.revision() == 0);
  FUZZ_ASSERT(kv.stored_entries() <= lim.max_stored_keys);
  FUZZ_ASSERT(kv.stored_bytes() <= lim.max_stored_bytes);
  kv.expire(~uint64_t{0} - 1);  // every timed waiter times out
  kv.close_session(1);
  FUZZ_ASSERT(kv.waiter_count() == 0);
  return 0;
}
