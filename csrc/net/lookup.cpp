#include "net/lookup.hpp"

#include <cerrno>
#include <thread>

namespace elasticstore {

std::shared_ptr<ResolveJob> start_lookup(const std::string& host, const std::string& service,
                                         const addrinfo& hints) {
  auto job = std::make_shared<ResolveJob>();
  std::thread([job, host, service, hints] {
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), service.empty() ? nullptr : service.c_str(),
                                 &hints, &res);
    const int err = errno;
    std::lock_guard<std::mutex> lock(job->mu);
    job->rc = rc;
    job->err = err;
    job->res = res;
    job->done = true;
    job->cv.notify_all();
  }).detach();
  return job;
}

}  // namespace elasticstore
