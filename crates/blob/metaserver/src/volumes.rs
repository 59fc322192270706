//! Volume lease requests on the leader (design 0007): pure translation
//! between the wire and the replicated state. A request becomes a
//! `MetaOp` stamped with the leader's clock (every replica then applies
//! the same time, `lease` being pure); the outcome goes back with the
//! time left rather than a time of day, so a holder never compares its
//! clock with the leader's.
//!
//! | request | checked here | becomes |
//! |---|---|---|
//! | `AcquireVolume` | holder 1..=`NAME_LEN_MAX` bytes, ttl 1..=`LEASE_TTL_MAX_MS` | `MetaOp::Acquire` |
//! | `RenewVolume` | the same | `MetaOp::Renew` |
//! | `ReleaseVolume` | — | `MetaOp::Release` |
//! | anything else | — | not a lease request (`None`) |

use blizzard_core::limits::NAME_LEN_MAX;
use blizzard_core::BlobId;
use blizzard_proto::{ErrorCode, ErrorReply, LeaseStatus, Request, VolumeLease};

use crate::lease::{Leases, Outcome};
use crate::machine::{MetaOp, LEASE_TTL_MAX_MS};

fn bad(msg: String) -> ErrorReply {
    ErrorReply::new(ErrorCode::BadRequest, msg)
}

fn check(holder: &str, ttl_ms: u64) -> Result<(), ErrorReply> {
    if holder.is_empty() || holder.len() > NAME_LEN_MAX {
        return Err(bad(format!(
            "a lease holder's name must be 1 to {NAME_LEN_MAX} bytes, not {}",
            holder.len()
        )));
    }
    if ttl_ms == 0 || ttl_ms > LEASE_TTL_MAX_MS {
        return Err(bad(format!("a lease lasts 1 ms to {LEASE_TTL_MAX_MS} ms, not {ttl_ms} ms")));
    }
    Ok(())
}

/// The update a lease request from `peer` (the name on its certificate,
/// "" for none) asks for, at the leader's `now_ms`; `None` for a request
/// that is not about leases.
pub(crate) fn op_for(req: &Request, now_ms: u64, peer: &str) -> Option<Result<(BlobId, MetaOp), ErrorReply>> {
    Some(match req {
        Request::AcquireVolume { blob, holder, ttl_ms, take_over } => check(holder, *ttl_ms).map(|()| {
            let op = MetaOp::Acquire {
                blob: *blob,
                holder: holder.clone(),
                now_ms,
                ttl_ms: *ttl_ms,
                take_over: *take_over,
                peer: peer.to_string(),
            };
            (*blob, op)
        }),
        Request::RenewVolume { blob, holder, token, ttl_ms } => check(holder, *ttl_ms).map(|()| {
            let op =
                MetaOp::Renew { blob: *blob, holder: holder.clone(), token: *token, now_ms, ttl_ms: *ttl_ms };
            (*blob, op)
        }),
        Request::ReleaseVolume { blob, token } => Ok((*blob, MetaOp::Release { blob: *blob, token: *token })),
        _ => return None,
    })
}

/// An outcome on the wire: time left from `now_ms` (the time the update
/// carried). `holder` is the caller's name, for a grant.
pub(crate) fn reply_for(blob: BlobId, caller: &str, outcome: &Outcome, now_ms: u64) -> VolumeLease {
    let lease = |status, holder: &str, token, expires_ms: u64| VolumeLease {
        status,
        blob,
        holder: holder.to_string(),
        token,
        remaining_ms: expires_ms.saturating_sub(now_ms),
    };
    match outcome {
        Outcome::Granted { token, expires_ms } => lease(LeaseStatus::Granted, caller, *token, *expires_ms),
        Outcome::Held { holder, expires_ms } => lease(LeaseStatus::Held, holder, 0, *expires_ms),
        Outcome::Lost { holder } => lease(LeaseStatus::Lost, holder.as_deref().unwrap_or(""), 0, 0),
        Outcome::Full => lease(LeaseStatus::Full, "", 0, 0),
    }
}

/// The live leases at `now_ms`, for `blizzard status`.
pub(crate) fn listed(leases: &Leases, now_ms: u64) -> Vec<VolumeLease> {
    let now = now_ms.max(leases.clock_ms());
    leases
        .iter()
        .filter(|(_, l)| l.expires_ms > now)
        .map(|(blob, l)| VolumeLease {
            status: LeaseStatus::Granted,
            blob: *blob,
            holder: l.holder.clone(),
            token: l.token,
            remaining_ms: l.expires_ms - now,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: BlobId = BlobId(7);

    fn update(req: &Request, now_ms: u64) -> (BlobId, MetaOp) {
        match op_for(req, now_ms, "nbd1") {
            Some(Ok(x)) => x,
            other => panic!("{req:?} did not become an update: {other:?}"),
        }
    }

    #[test]
    fn lease_requests_are_stamped_with_the_leaders_clock() {
        let req = Request::AcquireVolume { blob: B, holder: "h:1/a".into(), ttl_ms: 10_000, take_over: true };
        let (blob, op) = update(&req, 5_000);
        assert_eq!(blob, B);
        assert_eq!(
            op,
            MetaOp::Acquire {
                blob: B,
                holder: "h:1/a".into(),
                now_ms: 5_000,
                ttl_ms: 10_000,
                take_over: true,
                peer: "nbd1".into(),
            }
        );
        let req = Request::RenewVolume { blob: B, holder: "h:1/a".into(), token: 3, ttl_ms: 9 };
        assert!(matches!(update(&req, 1).1, MetaOp::Renew { token: 3, now_ms: 1, .. }));
        assert!(op_for(&Request::Ping, 0, "").is_none());
    }

    #[test]
    fn bad_holders_and_ttls_are_refused_before_proposing() {
        for (holder, ttl_ms) in [
            (String::new(), 1000),
            ("x".repeat(NAME_LEN_MAX + 1), 1000),
            ("h".into(), 0),
            ("h".into(), LEASE_TTL_MAX_MS + 1),
        ] {
            let req = Request::AcquireVolume { blob: B, holder, ttl_ms, take_over: false };
            assert!(matches!(op_for(&req, 0, ""), Some(Err(e)) if e.code == ErrorCode::BadRequest));
        }
    }

    #[test]
    fn outcomes_carry_time_left_not_a_time_of_day() {
        let g = reply_for(B, "me", &Outcome::Granted { token: 4, expires_ms: 12_000 }, 2_000);
        assert_eq!(
            (g.status, g.holder.as_str(), g.token, g.remaining_ms),
            (LeaseStatus::Granted, "me", 4, 10_000)
        );
        let h = reply_for(B, "me", &Outcome::Held { holder: "other".into(), expires_ms: 3_000 }, 2_000);
        assert_eq!(
            (h.status, h.holder.as_str(), h.token, h.remaining_ms),
            (LeaseStatus::Held, "other", 0, 1_000)
        );
        let l = reply_for(B, "me", &Outcome::Lost { holder: None }, 2_000);
        assert_eq!((l.status, l.holder.as_str()), (LeaseStatus::Lost, ""));
    }

    #[test]
    fn only_live_leases_are_listed() {
        let mut l = Leases::default();
        l.acquire(BlobId(1), "a", 0, 1_000, false);
        l.acquire(BlobId(2), "b", 0, 5_000, false);
        let v = listed(&l, 2_000);
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].blob, v[0].holder.as_str(), v[0].remaining_ms), (BlobId(2), "b", 3_000));
    }
}
