// The TLS server context both front ends (HTTP and gRPC) make from their
// PEM files: TLS 1.2 and later, the certificate chain and its key, and,
// when a client CA file is given, client certificates required and
// verified against it. Thread-compatible: a free function.
#pragma once

#include <boost/asio/ssl/context.hpp>
#include <memory>
#include <string>
#include <string_view>

#include "quern/status.h"

namespace quern {

// The context, or INVALID_ARGUMENT naming the file that cannot be used;
// `what` begins the message ("TLS", "gRPC TLS").
Result<std::unique_ptr<boost::asio::ssl::context>> MakeServerTlsContext(const std::string& cert_file,
                                                                        const std::string& key_file,
                                                                        const std::string& client_ca_file,
                                                                        std::string_view what);

}  // namespace quern
