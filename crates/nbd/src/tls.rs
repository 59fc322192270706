//! NBD over TLS: the STARTTLS option of the newstyle handshake (NBD
//! `doc/proto.md`, "TLS support"), as qemu-nbd and nbdkit serve it.
//!
//! Rules kept here:
//! - **Nothing before the upgrade when TLS is required.** Every option
//!   but STARTTLS and ABORT gets `NBD_REP_ERR_TLS_REQD`, so no export
//!   name, size or description is told to a client that has not upgraded
//!   ([`gate`]); EXPORT_NAME, which cannot be answered with an error,
//!   ends the connection.
//! - **Nothing carried across the upgrade.** The client must wait for the
//!   ACK before its ClientHello; bytes it sent after STARTTLS and before
//!   the ACK (read into our buffer in plain text) end the connection
//!   rather than being taken as if they came through TLS (the STARTTLS
//!   injection attack). Options negotiated before (structured replies,
//!   meta contexts) are forgotten: the handshake starts over inside TLS.
//! - **A bounded handshake.** The TLS handshake gets the same
//!   `handshake_timeout` as any handshake message, and rustls bounds its
//!   buffers, so a stalled, garbled or vanished client costs one
//!   connection slot for at most that long.

use std::sync::Arc;

use tokio_rustls::TlsAcceptor;

use blizzard_env::BoxStream;
use blizzard_tls::PeerIdentity;

use crate::metrics::Checked;
use crate::proto::{NBD_OPT_ABORT, NBD_OPT_EXPORT_NAME, NBD_OPT_STARTTLS};
use crate::server::{ConnError, Shared};

/// TLS for NBD clients.
#[derive(Clone, Debug)]
pub struct NbdTls {
    /// The server's certificate and how it checks clients' (see
    /// `blizzard_tls::server_config`).
    pub config: Arc<rustls::ServerConfig>,
    /// Clients must upgrade before anything else (`--tls require`);
    /// otherwise TLS is offered and plain clients are still served
    /// (`--tls on`).
    pub required: bool,
}

/// Where a connection stands with TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TlsState {
    pub(crate) offered: bool,
    pub(crate) required: bool,
    /// The connection runs inside TLS now.
    pub(crate) active: bool,
}

impl TlsState {
    pub(crate) fn of(tls: Option<&NbdTls>) -> TlsState {
        TlsState { offered: tls.is_some(), required: tls.is_some_and(|t| t.required), active: false }
    }
}

/// What the TLS policy says about an option, before it is looked at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    Proceed,
    /// Answer `NBD_REP_ERR_TLS_REQD`.
    TlsRequired,
    /// EXPORT_NAME before a required upgrade: no error reply exists for
    /// it, so the connection ends.
    Disconnect,
}

/// The TLS gate for `option` (pure).
pub(crate) fn gate(option: u32, tls: TlsState) -> Gate {
    if !tls.required || tls.active {
        return Gate::Proceed;
    }
    match option {
        NBD_OPT_STARTTLS | NBD_OPT_ABORT => Gate::Proceed,
        NBD_OPT_EXPORT_NAME => Gate::Disconnect,
        _ => Gate::TlsRequired,
    }
}

/// Runs the server side of a TLS handshake on `stream` (the client has
/// had STARTTLS's ACK), within the handshake timeout. Returns the stream
/// inside TLS and the identity of a verified client certificate.
pub(crate) async fn accept(
    stream: BoxStream,
    tls: &NbdTls,
    shared: &Shared,
) -> Result<(BoxStream, Option<PeerIdentity>), ConnError> {
    let acceptor = TlsAcceptor::from(tls.config.clone());
    let t = shared.cfg.handshake_timeout;
    let failed = |why: String| {
        shared.guard.count(Checked::TlsFailed);
        Err(ConnError::Tls(why))
    };
    let s = tokio::select! {
        biased;
        _ = shared.shutdown.wait() => return Err(ConnError::Shutdown),
        r = shared.env.timeout(t, acceptor.accept(blizzard_tls::Transport::new(stream))) => match r {
            Err(_) => return failed(format!("TLS handshake not done within {t:?}")),
            Ok(Err(e)) => return failed(format!("TLS handshake failed: {e}")),
            Ok(Ok(s)) => s,
        },
    };
    let mut s = s;
    // Up: the session's reads are buffered from here on.
    s.get_mut().0.buffer(blizzard_tls::TRANSPORT_READ_BUFFER);
    shared.guard.count(Checked::TlsOk);
    let conn = s.get_ref().1;
    tracing::debug!(version = ?conn.protocol_version(), suite = ?conn.negotiated_cipher_suite().map(|c| c.suite()), "TLS handshake done");
    let peer = s.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(|c| PeerIdentity::of(c));
    Ok((Box::new(s), peer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::*;

    /// Every option a client can send, known or not.
    const OPTIONS: [u32; 12] = [
        NBD_OPT_EXPORT_NAME,
        NBD_OPT_ABORT,
        NBD_OPT_LIST,
        NBD_OPT_STARTTLS,
        NBD_OPT_INFO,
        NBD_OPT_GO,
        NBD_OPT_STRUCTURED_REPLY,
        NBD_OPT_LIST_META_CONTEXT,
        NBD_OPT_SET_META_CONTEXT,
        4,
        11,
        0xdead_beef,
    ];

    #[test]
    fn only_starttls_and_abort_pass_before_a_required_upgrade() {
        let required = TlsState { offered: true, required: true, active: false };
        for o in OPTIONS {
            let want = match o {
                NBD_OPT_STARTTLS | NBD_OPT_ABORT => Gate::Proceed,
                NBD_OPT_EXPORT_NAME => Gate::Disconnect,
                _ => Gate::TlsRequired,
            };
            assert_eq!(gate(o, required), want, "option {o}");
            // Inside TLS, and where TLS is only offered or off, everything
            // goes on to the handshake's own rules.
            for s in [
                TlsState { active: true, ..required },
                TlsState { offered: true, required: false, active: false },
                TlsState::of(None),
            ] {
                assert_eq!(gate(o, s), Gate::Proceed, "option {o} in {s:?}");
            }
        }
    }
}
