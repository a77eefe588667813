"""TLS to engines: one client SSL context shared by every router -> engine connection.

An engine URL may be ``https://`` (a replica spec's ``url=``, or the ``kvroute.io/scheme: https`` pod
annotation). Everything that talks to engines must then agree on how the engine's certificate is verified: the
proxy's engine client (``router.engine.client``), health probes (``membership.health``), ``/metrics`` scrapes
(``membership.engine_metrics``) and ``/tokenize`` calls (``router.tokens.tokenizer``). They all take their context from
here, so one setting changes all of them.

Verification is always on: the engine's certificate must chain to a trusted CA and name the host of the URL.
``engine_ca_bundle`` (a PEM file) replaces the system's CA store for engines (e.g. the cluster's own CA);
``engine_client_cert`` / ``engine_client_key`` present a client certificate (mutual TLS).

``configure(...)`` is called once by the router's service builder with the values from ``Settings``; components
read ``client_context()`` when they create their HTTP clients. Without ``configure`` the system CA store is used.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineTLS:
    """How the router verifies engines and identifies itself to them.

    Attributes:
        ca_bundle: PEM file of CA certificates trusted for engines; None = the system's CA store.
        client_cert: PEM file of the router's client certificate (mutual TLS); None = none.
        client_key: PEM file of the client certificate's private key; None = inside ``client_cert``.
    """

    ca_bundle: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    def build_context(self) -> ssl.SSLContext:
        """A client context verifying certificates and host names with this configuration.

        Raises:
            ValueError: a file cannot be read or is not valid PEM (the message names the option).
        """
        try:
            ctx = ssl.create_default_context(cafile=self.ca_bundle)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"engine_ca_bundle {self.ca_bundle!r}: cannot load CA certificates: {exc}"
            ) from None
        if self.client_key and not self.client_cert:
            raise ValueError("engine_client_key is set without engine_client_cert")
        if self.client_cert:
            try:
                ctx.load_cert_chain(self.client_cert, self.client_key)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"engine_client_cert {self.client_cert!r}: cannot load the client certificate "
                    f"/ key: {exc}"
                ) from None
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


_config = EngineTLS()
_context: ssl.SSLContext | None = None


def configure(tls: EngineTLS) -> ssl.SSLContext:
    """Use ``tls`` for every engine connection from now on; returns the context (built and checked now).

    Raises:
        ValueError: as ``EngineTLS.build_context``.
    """
    global _config, _context
    ctx = tls.build_context()
    _config, _context = tls, ctx
    return ctx


def client_context() -> ssl.SSLContext:
    """The SSL context for connections to ``https://`` engines (built on first use when not configured)."""
    global _context
    if _context is None:
        _context = _config.build_context()
    return _context


def current() -> EngineTLS:
    """The configuration in use."""
    return _config
