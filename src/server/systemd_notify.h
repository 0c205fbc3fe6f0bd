// Readiness for systemd (Type=notify): a datagram such as "READY=1" to the
// socket named in $NOTIFY_SOCKET (sd_notify's protocol, without libsystemd).
// Nothing happens when the variable is unset.
#pragma once

#include <string_view>

namespace quern {

// False when $NOTIFY_SOCKET is set and the message could not be sent.
bool NotifySystemd(std::string_view message);

}  // namespace quern
