// Bounded forward host lookups, shared by the client's transport and the server binary's --host.
// A lookup (getaddrinfo, never a reverse one) runs on its own thread, so that a resolver that does
// not answer cannot hold a caller past its deadline. C++17, no Python.
#pragma once

#include <netdb.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

namespace elasticstore {

// One lookup's result. The thread owns a reference: a lookup abandoned at the caller's deadline
// finishes (and is freed) on its own.
struct ResolveJob {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int rc = 0;
  int err = 0;  // errno, for EAI_SYSTEM
  addrinfo* res = nullptr;
  ~ResolveJob() {
    if (res) ::freeaddrinfo(res);
  }
};

// Starts the lookup of host (service may be empty) with hints; wait on the job's cv for done.
std::shared_ptr<ResolveJob> start_lookup(const std::string& host, const std::string& service,
                                         const addrinfo& hints);

}  // namespace elasticstore
