#include "frontends/http/tls_context.h"

namespace quern {

Result<std::unique_ptr<boost::asio::ssl::context>> MakeServerTlsContext(const std::string& cert_file,
                                                                        const std::string& key_file,
                                                                        const std::string& client_ca_file,
                                                                        std::string_view what) {
  namespace ssl = boost::asio::ssl;
  const std::string w(what);
  boost::system::error_code ec;
  auto ctx = std::make_unique<ssl::context>(ssl::context::tls_server);
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                   ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 | ssl::context::single_dh_use);
  ctx->use_certificate_chain_file(cert_file, ec);
  if (ec) return Err(InvalidArgument(w + " certificate file '" + cert_file + "': " + ec.message()));
  ctx->use_private_key_file(key_file, ssl::context::pem, ec);
  if (ec) return Err(InvalidArgument(w + " key file '" + key_file + "': " + ec.message()));
  if (!client_ca_file.empty()) {
    ctx->load_verify_file(client_ca_file, ec);
    if (ec) return Err(InvalidArgument(w + " client CA file '" + client_ca_file + "': " + ec.message()));
    ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
  }
  return ctx;
}

}  // namespace quern
