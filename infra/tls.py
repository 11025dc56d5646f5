"""Transport security of every gRPC server and client in Tandem, from certificate paths.

    --tls-cert PEM --tls-key PEM     this process's certificate chain and key: servers listen with TLS,
                                     clients present them (client authentication)
    --tls-ca PEM                     the CA that signed the peers' certificates: clients verify servers
                                     against it; an internal service (target, draft) given a CA also
                                     requires a client certificate signed by it (mutual TLS)

No cert: plaintext, as before (the services bind loopback by default). Certificates must name the
address clients dial (a SAN for 127.0.0.1 / the host name). No torch here: the gateway uses it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def validate(self, prog: str) -> "TlsFiles":
        """A server's files: cert and key together; a CA only with them (it turns on mutual TLS)."""
        if bool(self.cert) != bool(self.key):
            raise SystemExit(f"{prog}: --tls-cert and --tls-key go together (got only "
                             f"{'--tls-cert' if self.cert else '--tls-key'})")
        if self.ca and not self.cert:
            raise SystemExit(f"{prog}: --tls-ca needs --tls-cert and --tls-key (with a CA, peers authenticate "
                             "each other: mutual TLS)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise SystemExit(f"{prog}: {flag} {path}: no such file")
        return self

    def _read(self, path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca),
                                           require_client_auth=require_client_cert and bool(self.ca))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca), private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))


PLAINTEXT = TlsFiles()


def add_port(server, addr: str, tls: TlsFiles = PLAINTEXT, require_client_cert: bool = True) -> int:
    """Listen on addr (TLS when tls has a cert); -> the bound port (0: failed)."""
    if not tls.cert:
        return server.add_insecure_port(addr)
    return server.add_secure_port(addr, tls.server_credentials(require_client_cert))


def channel(addr: str, tls: TlsFiles = PLAINTEXT, options=None) -> grpc.Channel:
    if not tls.enabled:
        return grpc.insecure_channel(addr, options=options)
    return grpc.secure_channel(addr, tls.channel_credentials(), options=options)


def aio_channel(addr: str, tls: TlsFiles = PLAINTEXT, options=None, interceptors=None) -> grpc.aio.Channel:
    if not tls.enabled:
        return grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(addr, tls.channel_credentials(), options=options, interceptors=interceptors)


def add_flags(parser) -> None:
    parser.add_argument("--tls-cert", default="", help="PEM certificate chain: serve gRPC over TLS and present "
                        "it to the services as a client certificate")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default="", help="PEM CA that signed the peers' certificates (verify them; "
                        "internal services then require client certificates: mutual TLS)")
