// libFuzzer target: torch's TCPStore scanner and decoder, and the codec over a KvState. Checks:
// the incremental Scanner, however the bytes are split, agrees with a one-shot scan and with
// parse_request (same verdict, same length); every close has a reason; quota never exceeded.
#include <string>

#include "fuzz_common.hpp"
#include "wire/tcpstore_protocol.hpp"

using namespace elasticstore;
namespace ts = elasticstore::tcpstore;

namespace {

void scanner_agrees(const std::string& in, const uint8_t* cuts, std::size_t ncuts) {
  std::string reason;
  ts::Scanner whole;
  const ts::Parse once = whole.scan(in.data(), in.size(), &reason);
  ts::Scanner split;
  ts::Parse step = ts::Parse::NeedMore;
  std::size_t avail = 0, cut = 0;
  while (step == ts::Parse::NeedMore && avail < in.size()) {
    avail = std::min(in.size(), avail + 1 + (ncuts ? cuts[cut++ % ncuts] : in.size()));
    std::string r;
    step = split.scan(in.data(), avail, &r);
  }
  FUZZ_ASSERT(step == once);
  ts::Request req;
  std::string r2;
  if (once == ts::Parse::Ready) {
    FUZZ_ASSERT(split.length() == whole.length());
    FUZZ_ASSERT(ts::parse_request(in.data(), whole.length(), &req, &r2) == ts::Parse::Ready);
    FUZZ_ASSERT(req.consumed == whole.length());
  } else if (once != ts::Parse::NeedMore) {
    FUZZ_ASSERT(!reason.empty());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::size_t ncuts = size ? data[0] % 8 : 0;
  if (size < 1 + ncuts) return 0;
  const std::string input(reinterpret_cast<const char*>(data) + 1 + ncuts, size - 1 - ncuts);
  scanner_agrees(input, data + 1, ncuts);
  StoreLimits lim;
  lim.max_key_bytes = 64;
  lim.max_value_bytes = 4096;
  lim.max_keys_per_request = 16;
  lim.max_stored_keys = 32;
  lim.max_stored_bytes = 16 * 1024;
  KvState kv([] { return uint64_t{0}; }, lim);
  kv.open_session(1);
  auto codec = make_tcpstore_codec();
  bool closed = false;
  fuzz::drive(*codec, kv, 1, input, data + 1, ncuts, &closed);
  if (!codec->handshake_done()) FUZZ_ASSERT(kv.num_keys() == 0);
  FUZZ_ASSERT(kv.stored_entries() <= lim.max_stored_keys);
  FUZZ_ASSERT(kv.stored_bytes() <= lim.max_stored_bytes);
  kv.close_session(1);
  FUZZ_ASSERT(kv.waiter_count() == 0);
  return 0;
}
