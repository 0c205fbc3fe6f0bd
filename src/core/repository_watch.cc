#include "core/repository_watch.h"

#include <sys/inotify.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

namespace quern {
namespace {

constexpr uint32_t kModelEvents = IN_CREATE | IN_DELETE | IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO |
                                  IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF;
constexpr uint32_t kRootEvents =
    IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF;

}  // namespace

std::unique_ptr<RepositoryWatch> RepositoryWatch::Start(const std::filesystem::path& repo) {
  const int fd = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd < 0) return nullptr;
  const int root = ::inotify_add_watch(fd, repo.c_str(), kRootEvents | IN_ONLYDIR);
  if (root < 0) {
    ::close(fd);
    return nullptr;
  }
  return std::unique_ptr<RepositoryWatch>(new RepositoryWatch(repo, fd, root));
}

RepositoryWatch::RepositoryWatch(std::filesystem::path repo, int fd, int root_wd)
    : repo_(std::move(repo)), fd_(fd), root_wd_(root_wd) {}

RepositoryWatch::~RepositoryWatch() {
  ::close(fd_);  // closes every watch
}

bool RepositoryWatch::AddTree(const std::string& name, const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> todo{dir};
  auto& mine = watches_[name];
  while (!todo.empty()) {
    if (mine.size() >= static_cast<size_t>(kMaxWatchesPerModel)) return false;
    const std::filesystem::path d = std::move(todo.back());
    todo.pop_back();
    const int wd = ::inotify_add_watch(fd_, d.c_str(), kModelEvents | IN_ONLYDIR);
    if (wd < 0) {
      if (errno == ENOTDIR || errno == ENOENT) continue;  // gone meanwhile: its event says so
      return false;
    }
    // The same folder reached twice (a link inside the model) is one watch.
    if (!mine.insert(wd).second) continue;
    model_of_[wd] = name;
    dir_of_[wd] = d;
    std::error_code ec;
    for (auto it = std::filesystem::directory_iterator(d, ec); !ec && it != std::filesystem::directory_iterator();
         it.increment(ec)) {
      std::error_code type_ec;
      if (it->is_directory(type_ec) && !it->is_symlink(type_ec)) todo.push_back(it->path());
    }
  }
  return true;
}

void RepositoryWatch::Watch(const std::string& name) {
  Forget(name);
  if (!AddTree(name, repo_ / name)) partial_.insert(name);
}

void RepositoryWatch::Forget(const std::string& name) {
  auto it = watches_.find(name);
  if (it != watches_.end()) {
    for (int wd : it->second) {
      ::inotify_rm_watch(fd_, wd);
      model_of_.erase(wd);
      dir_of_.erase(wd);
    }
    watches_.erase(it);
  }
  partial_.erase(name);
}

RepositoryWatch::Changes RepositoryWatch::Take() {
  alignas(inotify_event) char buf[64 << 10];
  for (;;) {
    const ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n <= 0) break;  // EAGAIN: nothing more
    for (ssize_t off = 0; off < n;) {
      const auto* e = reinterpret_cast<const inotify_event*>(buf + off);
      off += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
      if (e->mask & IN_Q_OVERFLOW) {
        lost_ = true;
        continue;
      }
      if (e->wd == root_wd_) {
        pending_.listing = true;
        if (e->len > 0) {
          pending_.models.insert(e->name);  // a model folder made, removed or renamed
          pending_.replaced.insert(e->name);
        }
        if (e->mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED)) {
          lost_ = true;
          root_wd_ = -1;
        }
        continue;
      }
      auto m = model_of_.find(e->wd);
      if (m == model_of_.end()) continue;  // a watch removed meanwhile
      const std::string name = m->second;
      pending_.models.insert(name);
      if ((e->mask & IN_ISDIR) && (e->mask & (IN_CREATE | IN_MOVED_TO)) && e->len > 0) {
        // A new folder (a version being added): watched too.
        if (!AddTree(name, dir_of_[e->wd] / e->name)) partial_.insert(name);
      }
      if (e->mask & IN_IGNORED) {
        model_of_.erase(e->wd);
        dir_of_.erase(e->wd);
        if (auto w = watches_.find(name); w != watches_.end()) w->second.erase(e->wd);
      }
    }
  }
  if (root_wd_ < 0) {
    // The repository's folder was replaced (a link swapped to a new one):
    // watched again where it is now; what happened meanwhile is looked at whole.
    root_wd_ = ::inotify_add_watch(fd_, repo_.c_str(), kRootEvents | IN_ONLYDIR);
    lost_ = true;
  }
  Changes out = std::move(pending_);
  pending_ = Changes();
  out.everything = lost_;
  lost_ = false;
  out.models.insert(partial_.begin(), partial_.end());
  return out;
}

}  // namespace quern
