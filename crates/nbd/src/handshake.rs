//! Fixed newstyle negotiation: the greeting, the client's flags, then
//! options until NBD_OPT_GO succeeds, NBD_OPT_EXPORT_NAME names an export,
//! or the client aborts.
//!
//! Rules kept here (NBD `doc/proto.md`, "Handshake" and "Option types"):
//! - the server answers every option except EXPORT_NAME with one or more
//!   replies ending in ACK or an error, and never fails to parse the next
//!   option after an unknown one (its length lets us skip it);
//! - EXPORT_NAME cannot return an error, so an unknown export ends the
//!   session (a hard disconnect);
//! - SET_META_CONTEXT replaces the selection even when it fails, and the
//!   selection counts only if it named the export finally chosen;
//! - each client message must arrive within `handshake_timeout`, and an
//!   option's data is bounded by `OPTION_LEN_MAX` before it is read;
//! - STARTTLS ends one round of haggling and the next starts from nothing
//!   inside TLS; before a required upgrade only STARTTLS and ABORT are
//!   answered (`tls::gate`).

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tracing::{debug, warn};

use blizzard_volume::access::{self, Access};
use blizzard_volume::{CommitMode, Volume, VolumeError};

use crate::metrics::Checked;
use crate::proto::*;
use crate::server::{ConnError, Shared};
use crate::tls::{gate, Gate, TlsState};

/// The context id handed out for `base:allocation` (any value works; the
/// client treats it as opaque).
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;

/// The outcome of a successful negotiation.
pub(crate) struct Negotiated {
    pub(crate) name: String,
    pub(crate) volume: Arc<Volume>,
    pub(crate) session: Session,
    /// This client may only read: the volume is read-only, or its access
    /// list says so for this client.
    pub(crate) read_only: bool,
    /// The serial number of the client's verified certificate, if it has
    /// one: its revocation closes the connection.
    pub(crate) serial: Option<String>,
}

/// Transmission flags for an export. DF only when structured replies were
/// negotiated (the spec: MUST leave it clear otherwise). A read-only volume
/// (`Volume::is_read_only`) gets READ_ONLY and none of the flags that only
/// matter for changing it (TRIM, WRITE_ZEROES, FAST_ZERO, FUA), as nbdkit
/// does; FLUSH stays (it succeeds, with nothing to flush), and so does
/// CAN_MULTI_CONN (there is nothing to become inconsistent).
pub(crate) fn transmission_flags(structured: bool, read_only: bool) -> u16 {
    let mut f = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        // One shared Volume per export: a FLUSH or FUA on any connection
        // covers writes completed on all of them.
        | NBD_FLAG_CAN_MULTI_CONN;
    if read_only {
        f |= NBD_FLAG_READ_ONLY;
    } else {
        f |= NBD_FLAG_SEND_FUA
            | NBD_FLAG_SEND_TRIM
            | NBD_FLAG_SEND_WRITE_ZEROES
            // Write zeroes without NO_HOLE unmaps (or records zeros), which
            // is cheaper than writing the bytes; with NO_HOLE it fails fast.
            | NBD_FLAG_SEND_FAST_ZERO;
    }
    if structured {
        f |= NBD_FLAG_SEND_DF;
    }
    f
}

/// The preferred block size: the smallest write that avoids a
/// read-modify-write. Write-through and fast-ack volumes merge partial
/// writes per 4 KiB chunk on the tractservers; a log volume logs whole
/// volume blocks, so its block size is what avoids a merge (capped at
/// 64 KiB so clients do not inflate small writes).
pub(crate) fn preferred_block_size(v: &Volume) -> u32 {
    match v.superblock().mode {
        CommitMode::Log => v.block_size().clamp(4096, 64 << 10),
        CommitMode::WriteThrough | CommitMode::FastAck => 4096,
    }
}

fn description(name: &str, v: &Volume) -> String {
    let sb = v.superblock();
    if let Some(s3) = sb.backend.s3() {
        return format!("blizzard volume {name}: {} bytes, S3 (LSVD) at {}", sb.size_bytes, s3.url);
    }
    format!(
        "blizzard volume {name}: {} bytes, {} commit, {} flush, {}-byte blocks, {} replicas",
        sb.size_bytes,
        sb.mode.name(),
        sb.flush.name(),
        sb.block_size,
        sb.replication
    )
}

struct Haggle<'a, S> {
    s: &'a mut S,
    shared: &'a Shared,
    peer: &'a str,
    tls: TlsState,
    /// The client's verified identity (its certificate's name), if any.
    client: Option<&'a str>,
    structured: bool,
    /// The last SET_META_CONTEXT: the export it named (resolved) and whether
    /// it selected `base:allocation`.
    meta: Option<(String, bool)>,
}

/// How option haggling ended.
pub(crate) enum Outcome {
    /// The client aborted (a soft disconnect).
    Aborted,
    /// An export was chosen: the transmission phase follows.
    Ready(Negotiated),
    /// STARTTLS was acknowledged: the caller runs the TLS handshake, then
    /// haggles again from scratch inside it.
    StartTls,
}

/// Sends the greeting and reads the client's flags. Returns whether the
/// client asked for no zeroes after EXPORT_NAME's reply.
pub(crate) async fn greet<S>(s: &mut S, shared: &Shared, peer: &str) -> Result<bool, ConnError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    s.write_all(&encode_greeting()).await?;
    s.flush().await?;
    let mut h =
        Haggle { s, shared, peer, tls: TlsState::of(None), client: None, structured: false, meta: None };
    let mut flags = [0u8; 4];
    h.read_exact(&mut flags).await?;
    let cf =
        decode_client_flags(u32::from_be_bytes(flags)).map_err(|e| ConnError::Protocol(e.to_string()))?;
    Ok(cf.no_zeroes)
}

/// Runs the option haggling on `s`, under the TLS state `tls` (options
/// negotiated before a STARTTLS do not carry over: each call starts
/// fresh), for a client whose verified identity is `client`.
pub(crate) async fn negotiate<S>(
    s: &mut S,
    shared: &Shared,
    peer: &str,
    no_zeroes: bool,
    tls: TlsState,
    client: Option<&str>,
) -> Result<Outcome, ConnError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut h = Haggle { s, shared, peer, tls, client, structured: false, meta: None };
    loop {
        let mut hdr = [0u8; OPTION_HEADER_LEN];
        h.read_exact(&mut hdr).await?;
        let hdr =
            decode_option_header(&hdr).map_err(|e| ConnError::Protocol(format!("option header: {e}")))?;
        if hdr.len > OPTION_LEN_MAX {
            // Too large to buffer, and skipping it would let a client make
            // us read gigabytes: say why (where a reply is possible), then
            // hang up.
            if hdr.option != NBD_OPT_EXPORT_NAME {
                let msg = format!("option data of {} bytes exceeds {OPTION_LEN_MAX}", hdr.len);
                h.reply(hdr.option, NBD_REP_ERR_TOO_BIG, message_bytes(&msg)).await?;
            }
            return Err(ConnError::Protocol(format!("option {} with {} bytes of data", hdr.option, hdr.len)));
        }
        let mut data = vec![0u8; hdr.len as usize];
        h.read_exact(&mut data).await?;
        match gate(hdr.option, h.tls) {
            Gate::Proceed => {}
            Gate::TlsRequired => {
                h.shared.guard.count(Checked::TlsRequired);
                let msg = "this server requires TLS: upgrade with NBD_OPT_STARTTLS first (nbds:// with libnbd, tls-creds with qemu)";
                h.error(hdr.option, NBD_REP_ERR_TLS_REQD, msg).await?;
                continue;
            }
            Gate::Disconnect => {
                h.shared.guard.count(Checked::TlsRequired);
                return Err(ConnError::Protocol(
                    "NBD_OPT_EXPORT_NAME before the TLS this server requires".into(),
                ));
            }
        }
        let opt = match decode_option(hdr.option, &data) {
            Ok(o) => o,
            Err(e) if hdr.option == NBD_OPT_EXPORT_NAME => {
                return Err(ConnError::Protocol(format!("NBD_OPT_EXPORT_NAME: {e}")));
            }
            Err(e) => {
                warn!(peer = %h.peer, option = hdr.option, error = %e, "malformed NBD option");
                h.reply(hdr.option, NBD_REP_ERR_INVALID, message_bytes(&e.0)).await?;
                continue;
            }
        };
        debug!(peer = %h.peer, option = ?opt, "NBD option");
        if let Some(done) = h.option(opt, no_zeroes).await? {
            return Ok(done);
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Haggle<'_, S> {
    /// Reads exactly `buf` from the client, within the handshake timeout,
    /// unless the server is stopping.
    async fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ConnError> {
        let t = self.shared.cfg.handshake_timeout;
        tokio::select! {
            biased;
            _ = self.shared.shutdown.wait() => Err(ConnError::Shutdown),
            r = self.shared.env.timeout(t, self.s.read_exact(buf)) => match r {
                Err(_) => Err(ConnError::Timeout(t)),
                Ok(Err(e)) => Err(e.into()),
                Ok(Ok(_)) => Ok(()),
            },
        }
    }

    async fn reply(&mut self, option: u32, reply_type: u32, data: &[u8]) -> Result<(), ConnError> {
        self.s.write_all(&encode_option_reply(option, reply_type, data)).await?;
        self.s.flush().await?;
        Ok(())
    }

    async fn error(&mut self, option: u32, reply_type: u32, msg: &str) -> Result<(), ConnError> {
        self.reply(option, reply_type, message_bytes(msg)).await
    }

    /// The export a client's name refers to: the empty name is the
    /// configured default.
    fn resolve(&self, name: &str) -> Option<String> {
        if name.is_empty() {
            self.shared.cfg.default_export.clone()
        } else {
            Some(name.to_string())
        }
    }

    /// What the export's access list grants this client (checked before
    /// the volume is opened); `Err` with the reason if it cannot be read.
    /// (`&mut self`: a `&Haggle` held across the await would need the
    /// stream to be `Sync`.)
    async fn access(&mut self, name: &str) -> Result<Access, VolumeError> {
        let list = self.shared.registry.access(name).await?;
        Ok(access::check(&list, self.client))
    }

    /// What a client is told of an export it may not have: the same
    /// words for a volume whose access list leaves it out as for a name
    /// no volume has, so that guessed names cannot be confirmed (issue
    /// 56). The server's log says which it was.
    fn unavailable(name: &str) -> String {
        format!(
            "no export {name:?} for this client: no such volume, or its access list does not name this client's certificate (NBD_OPT_LIST, e.g. `nbdinfo --list`, shows the exports it may use)"
        )
    }

    /// Whether this client may have export `name`, and read-only if so;
    /// `Err` with the refusal to send: [`Haggle::unavailable`] for a name
    /// the client may not have or no volume has, the reason for an access
    /// list that cannot be read now (refused then: an unread list grants
    /// nothing).
    async fn admit(&mut self, name: &str) -> Result<bool, (u32, String)> {
        match self.access(name).await {
            Ok(Access::Denied) => {
                self.shared.guard.count(Checked::AccessDenied);
                warn!(peer = %self.peer, client = ?self.client, export = %name, "NBD client refused by the export's access list");
                Err((NBD_REP_ERR_UNKNOWN, Self::unavailable(name)))
            }
            Ok(a) => Ok(a == Access::ReadOnly),
            Err(VolumeError::NotFound(_)) => Err((NBD_REP_ERR_UNKNOWN, Self::unavailable(name))),
            Err(e) => {
                warn!(peer = %self.peer, export = %name, error = %e, "cannot read the access list of a volume");
                Err((NBD_REP_ERR_UNKNOWN, format!("export {name:?} cannot be opened now: {e}")))
            }
        }
    }

    /// The volume `name` names, opened, for a client its access list
    /// admitted; `Err` with the refusal as [`Haggle::admit`] gives it.
    async fn open(&mut self, name: &str) -> Result<Arc<Volume>, String> {
        match self.shared.registry.get(name).await {
            Ok(v) => Ok(v),
            // Gone since its list was read.
            Err(VolumeError::NotFound(_)) => Err(Self::unavailable(name)),
            Err(e) => {
                warn!(peer = %self.peer, export = %name, error = %e, "cannot open volume");
                Err(e.to_string())
            }
        }
    }

    /// Opens the export `name` names, or answers the option with the error
    /// (`None`). Also says whether this client may only read it.
    async fn export(
        &mut self,
        option: u32,
        name: &str,
    ) -> Result<Option<(String, Arc<Volume>, bool)>, ConnError> {
        let Some(resolved) = self.resolve(name) else {
            self.error(option, NBD_REP_ERR_UNKNOWN, "this server has no default export; name one").await?;
            return Ok(None);
        };
        let acl_read_only = match self.admit(&resolved).await {
            Ok(ro) => ro,
            Err((code, msg)) => {
                self.error(option, code, &msg).await?;
                return Ok(None);
            }
        };
        // "The requested export is not available" covers both a missing
        // volume and one that cannot be opened now; the message tells
        // which, to a client the list admits.
        match self.open(&resolved).await {
            Ok(v) => {
                let ro = acl_read_only || v.is_read_only();
                Ok(Some((resolved, v, ro)))
            }
            Err(msg) => {
                self.error(option, NBD_REP_ERR_UNKNOWN, &msg).await?;
                Ok(None)
            }
        }
    }

    fn session(&self, name: &str, v: &Volume) -> Session {
        let selected = matches!(&self.meta, Some((n, true)) if n == name);
        Session {
            size: v.size(),
            structured: self.structured,
            base_allocation: selected.then_some(BASE_ALLOCATION_ID),
        }
    }

    /// Handles one option. `Some(..)` ends the negotiation.
    async fn option(&mut self, opt: ClientOption, no_zeroes: bool) -> Result<Option<Outcome>, ConnError> {
        let code = opt.code();
        match opt {
            ClientOption::ExportName(name) => {
                let Some(resolved) = self.resolve(&name) else {
                    return Err(ConnError::Export { name, reason: "no default export".into() });
                };
                // No error reply exists for EXPORT_NAME: a refusal ends
                // the connection.
                let acl_read_only = match self.admit(&resolved).await {
                    Ok(ro) => ro,
                    Err((_, reason)) => return Err(ConnError::Export { name: resolved, reason }),
                };
                let volume = match self.open(&resolved).await {
                    Ok(v) => v,
                    Err(reason) => return Err(ConnError::Export { name: resolved, reason }),
                };
                let read_only = acl_read_only || volume.is_read_only();
                let session = self.session(&resolved, &volume);
                let flags = transmission_flags(session.structured, read_only);
                self.s.write_all(&encode_export_name_reply(session.size, flags, no_zeroes)).await?;
                self.s.flush().await?;
                Ok(Some(Outcome::Ready(Negotiated {
                    name: resolved,
                    volume,
                    session,
                    read_only,
                    serial: None,
                })))
            }
            ClientOption::Abort => {
                // The client may already have gone; that is fine.
                let _ = self.reply(code, NBD_REP_ACK, &[]).await;
                Ok(Some(Outcome::Aborted))
            }
            ClientOption::List => {
                match self.shared.registry.list().await {
                    Ok(exports) => {
                        // Only what this client may use.
                        let client = self.client;
                        let visible =
                            exports.iter().filter(|e| access::check(&e.access, client) != Access::Denied);
                        for e in visible {
                            self.reply(code, NBD_REP_SERVER, &encode_rep_server(&e.name, "")).await?;
                        }
                        self.reply(code, NBD_REP_ACK, &[]).await?;
                    }
                    Err(e) => {
                        // No reply type fits "the cluster cannot be listed
                        // right now"; PLATFORM with the reason is closest.
                        warn!(peer = %self.peer, error = %e, "cannot list volumes");
                        self.error(code, NBD_REP_ERR_PLATFORM, &format!("cannot list volumes: {e}")).await?;
                    }
                }
                Ok(None)
            }
            ClientOption::StartTls => {
                if !self.tls.offered {
                    let msg = "TLS is not enabled on this server (it was started without --tls-certificates)";
                    self.error(code, NBD_REP_ERR_UNSUP, msg).await?;
                    return Ok(None);
                }
                if self.tls.active {
                    self.error(code, NBD_REP_ERR_INVALID, "TLS is already negotiated").await?;
                    return Ok(None);
                }
                self.reply(code, NBD_REP_ACK, &[]).await?;
                Ok(Some(Outcome::StartTls))
            }
            ClientOption::Info(req) | ClientOption::Go(req) => {
                let Some((name, volume, read_only)) = self.export(code, &req.name).await? else {
                    return Ok(None);
                };
                let session = self.session(&name, &volume);
                let flags = transmission_flags(session.structured, read_only);
                self.reply(code, NBD_REP_INFO, &encode_info_export(session.size, flags)).await?;
                if req.info.contains(&NBD_INFO_NAME) {
                    self.reply(code, NBD_REP_INFO, &encode_info_string(NBD_INFO_NAME, &name)).await?;
                }
                if req.info.contains(&NBD_INFO_DESCRIPTION) {
                    let d = description(&name, &volume);
                    self.reply(code, NBD_REP_INFO, &encode_info_string(NBD_INFO_DESCRIPTION, &d)).await?;
                }
                // Sent whether asked or not: the values are the spec's
                // defaults (minimum 1, maximum 2^25), so a client that did
                // not ask loses nothing, and one that did learns the
                // preferred size.
                let bs =
                    encode_info_block_size(BLOCK_SIZE_MIN, preferred_block_size(&volume), PAYLOAD_ADVERTISED);
                self.reply(code, NBD_REP_INFO, &bs).await?;
                self.reply(code, NBD_REP_ACK, &[]).await?;
                if code == NBD_OPT_GO {
                    return Ok(Some(Outcome::Ready(Negotiated {
                        name,
                        volume,
                        session,
                        read_only,
                        serial: None,
                    })));
                }
                Ok(None)
            }
            ClientOption::StructuredReply => {
                self.structured = true;
                self.reply(code, NBD_REP_ACK, &[]).await?;
                Ok(None)
            }
            ClientOption::ListMetaContext(m) => {
                if self.export(code, &m.export).await?.is_none() {
                    return Ok(None);
                }
                // No queries lists everything; `base:` is the namespace's
                // wildcard; queries in other namespaces are ignored.
                let listed =
                    m.queries.is_empty() || m.queries.iter().any(|q| q == "base:" || q == BASE_ALLOCATION);
                if listed {
                    // The id in LIST replies is reserved: zero.
                    self.reply(code, NBD_REP_META_CONTEXT, &encode_meta_context(0, BASE_ALLOCATION)).await?;
                }
                self.reply(code, NBD_REP_ACK, &[]).await?;
                Ok(None)
            }
            ClientOption::SetMetaContext(m) => {
                // Replaces the previous selection even if it fails.
                self.meta = None;
                if !self.structured {
                    let msg = "NBD_OPT_SET_META_CONTEXT needs structured replies first";
                    self.error(code, NBD_REP_ERR_INVALID, msg).await?;
                    return Ok(None);
                }
                let Some((name, _, _)) = self.export(code, &m.export).await? else {
                    return Ok(None);
                };
                // Only the exact name selects; `base:` must be ignored here,
                // and unknown contexts are not errors.
                let selected = m.queries.iter().any(|q| q == BASE_ALLOCATION);
                if selected {
                    let d = encode_meta_context(BASE_ALLOCATION_ID, BASE_ALLOCATION);
                    self.reply(code, NBD_REP_META_CONTEXT, &d).await?;
                }
                self.reply(code, NBD_REP_ACK, &[]).await?;
                self.meta = Some((name, selected));
                Ok(None)
            }
            ClientOption::Unsupported(o) => {
                self.error(o, NBD_REP_ERR_UNSUP, &format!("option {o} is not supported")).await?;
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags that only matter for changing an export.
    const CHANGES: u16 =
        NBD_FLAG_SEND_FUA | NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO;

    /// The advertised flags for a writable volume: everything implemented,
    /// DF only with structured replies, not read-only.
    #[test]
    fn flags() {
        let f = transmission_flags(false, false);
        assert_eq!(f & NBD_FLAG_SEND_DF, 0);
        assert_eq!(f & NBD_FLAG_READ_ONLY, 0);
        assert_ne!(f & NBD_FLAG_CAN_MULTI_CONN, 0);
        assert_ne!(transmission_flags(true, false) & NBD_FLAG_SEND_DF, 0);
        assert_ne!(f & NBD_FLAG_HAS_FLAGS, 0);
        assert_ne!(f & NBD_FLAG_SEND_FLUSH, 0);
        assert_eq!(f & CHANGES, CHANGES);
    }

    /// A read-only volume: READ_ONLY and none of the flags for changing
    /// data; FLUSH, CAN_MULTI_CONN and DF as for a writable one.
    #[test]
    fn flags_read_only() {
        for structured in [false, true] {
            let f = transmission_flags(structured, true);
            assert_ne!(f & NBD_FLAG_READ_ONLY, 0);
            assert_eq!(f & CHANGES, 0, "{f:#x}");
            assert_ne!(f & NBD_FLAG_HAS_FLAGS, 0);
            assert_ne!(f & NBD_FLAG_SEND_FLUSH, 0);
            assert_ne!(f & NBD_FLAG_CAN_MULTI_CONN, 0);
            assert_eq!(f & NBD_FLAG_SEND_DF != 0, structured);
            let writable = transmission_flags(structured, false);
            assert_eq!(f, (writable & !CHANGES) | NBD_FLAG_READ_ONLY);
        }
    }
}
