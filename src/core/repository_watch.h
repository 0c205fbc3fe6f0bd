// RepositoryWatch: which models of a repository may have changed since the
// last look, from the kernel's file events (inotify), so that a poll looks
// only at those instead of every file of every model (a repository with a
// folder of 100,000 files cost half a core to poll every second).
//
// It watches the repository folder (models appear, go, are renamed) and
// each model's folder tree (bounded: a model with more folders than
// kMaxWatchesPerModel is reported changed at every look instead). Events
// lost (the kernel's queue overflowed, a watch could not be added) make the
// next look report everything. Network file systems may not report changes
// made on other machines: callers still look at everything now and then.
//
// Thread safety: one caller at a time (the registry's poll).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>

namespace quern {

class RepositoryWatch {
 public:
  static constexpr int kMaxWatchesPerModel = 256;

  // Null when the repository cannot be watched (no inotify, a limit hit).
  static std::unique_ptr<RepositoryWatch> Start(const std::filesystem::path& repo);
  ~RepositoryWatch();
  RepositoryWatch(const RepositoryWatch&) = delete;
  RepositoryWatch& operator=(const RepositoryWatch&) = delete;

  struct Changes {
    bool everything = false;       // look at every model (events were lost)
    bool listing = false;          // the repository folder's entries changed
    std::set<std::string> models;  // models whose files may have changed
    // Models whose folder itself was made, removed or renamed (their
    // watches are to be made anew).
    std::set<std::string> replaced;
  };
  // What happened since the last call (never blocks).
  Changes Take();

  // Watches model `name`'s folder tree (again, when it was replaced).
  // A model not watched, or watched only in part, is in every Take's models.
  void Watch(const std::string& name);
  // Forgets model `name` (it left the repository).
  void Forget(const std::string& name);

 private:
  RepositoryWatch(std::filesystem::path repo, int fd, int root_wd);
  // Adds watches for `dir` and its folders, as `name`'s; false when a
  // watch could not be added or the bound was reached.
  bool AddTree(const std::string& name, const std::filesystem::path& dir);

  const std::filesystem::path repo_;
  const int fd_;
  int root_wd_;                                   // -1 while the repository folder is gone
  std::map<int, std::string> model_of_;           // watch -> model
  std::map<int, std::filesystem::path> dir_of_;   // watch -> folder
  std::map<std::string, std::set<int>> watches_;  // model -> its watches
  std::set<std::string> partial_;                 // models watched in part: always changed
  bool lost_ = false;                             // events lost since the last Take
  Changes pending_;
};

}  // namespace quern
