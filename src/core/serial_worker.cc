#include "core/serial_worker.h"

#include "core/cpus.h"

namespace quern {

SerialWorker::SerialWorker(std::string name, size_t max_queued)
    : name_(std::move(name)), max_queued_(max_queued), thread_([this] { Run(); }) {}

SerialWorker::~SerialWorker() {
  Stop();
}

bool SerialWorker::Post(std::function<void()> job) {
  MutexLock lock(mu_);
  if (stopping_ || jobs_.size() >= max_queued_) return false;
  jobs_.push_back(std::move(job));
  cv_.Signal();
  return true;
}

void SerialWorker::Stop() {
  std::deque<std::function<void()>> dropped;
  {
    MutexLock lock(mu_);
    stopping_ = true;
    dropped.swap(jobs_);
    cv_.Signal();
  }
  dropped.clear();  // outside the lock: a job may hold what takes it
  if (thread_.joinable()) thread_.join();
}

void SerialWorker::Run() {
  NameThisThread(name_.c_str());
  MutexLock lock(mu_);
  while (true) {
    while (!stopping_ && jobs_.empty()) cv_.Wait(lock);
    if (stopping_) return;
    auto job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.Unlock();
    job();
    job = nullptr;
    lock.Lock();
  }
}

}  // namespace quern
