#include "server/systemd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>

namespace quern {

bool NotifySystemd(std::string_view message) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (!path || !*path) return true;
  const size_t len = std::strlen(path);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((path[0] != '/' && path[0] != '@') || len >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0';  // an abstract socket
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const auto size = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len);
  const ssize_t sent =
      ::sendto(fd, message.data(), message.size(), MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&addr), size);
  ::close(fd);
  return sent == static_cast<ssize_t>(message.size());
}

}  // namespace quern
