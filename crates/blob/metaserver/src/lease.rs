//! Volume leases: one writer per volume (Ursa's single-client lease, seed
//! 003 §4). Pure and deterministic: time comes in with each request (the
//! proposing server's clock, in milliseconds) so every replica of the
//! metadata service that applies the same requests holds the same table.
//!
//! A lease names its holder (a process: `host:pid/nonce`), a fencing
//! token and an expiry. Tokens only grow, across every volume, every
//! holder and every leader: a new holder's token is above every token
//! handed out before, so the tractservers' writer fence (which refuses a
//! change carrying an older writer than the newest it has seen for the
//! blob) keeps a replaced holder's late writes out once the new one has
//! claimed the volume. The lease itself keeps well-behaved writers apart;
//! the token keeps the volume safe when one of them is not (paused, cut
//! off, or slow to notice it lost the lease).
//!
//! | request | state of the volume's lease | outcome |
//! |---|---|---|
//! | acquire | none, or expired | granted under a new token |
//! | acquire | held by the same holder | the same lease, renewed (a retried acquire) |
//! | acquire | held by another, not expired | refused, naming the holder and when the lease ends |
//! | acquire with take-over | held by another | granted under a new token (the operator says the holder is dead) |
//! | renew | held by the holder under that token | expiry moved on |
//! | renew | expired, not taken by anyone since | granted again under the same token |
//! | renew | taken over (another token) or released | refused: lost, naming the new holder if any |
//! | release | held under that token | freed; the next acquire needs no wait |
//! | release | another token | nothing changes (a late release of a lost lease) |
//! | new leader | leases as the log left them | each lasts at least one term from the takeover ([`Leases::extend_all`]): the new leader's clock may be behind the old one's |
//! | table full | `LEASES_MAX` volumes listed | ended leases are forgotten; if every one is live, acquire refused |

use std::collections::BTreeMap;

use blizzard_core::BlobId;

/// Most volumes leased at once.
pub const LEASES_MAX: usize = 1 << 20;

/// One volume's lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub holder: String,
    pub token: u64,
    pub expires_ms: u64,
}

/// What an acquire or renew comes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The caller holds the volume under `token` until `expires_ms`.
    Granted { token: u64, expires_ms: u64 },
    /// Another holder has it until `expires_ms`.
    Held { holder: String, expires_ms: u64 },
    /// (Renew) the caller's lease is gone: released, or taken over by
    /// `holder` (if any holds it now).
    Lost { holder: Option<String> },
    /// No room for another lease.
    Full,
}

/// Every volume's lease, and the newest token handed out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leases {
    by_blob: BTreeMap<BlobId, Lease>,
    last_token: u64,
    /// The latest time any request carried: time never goes back here,
    /// whichever server's clock proposed it.
    clock_ms: u64,
}

impl Leases {
    /// The table as a snapshot stored it.
    pub fn from_parts(
        leases: impl IntoIterator<Item = (BlobId, Lease)>,
        last_token: u64,
        clock_ms: u64,
    ) -> Leases {
        let by_blob: BTreeMap<BlobId, Lease> = leases.into_iter().collect();
        let last_token = by_blob.values().map(|l| l.token).fold(last_token, u64::max);
        Leases { by_blob, last_token, clock_ms }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&BlobId, &Lease)> {
        self.by_blob.iter()
    }

    pub fn last_token(&self) -> u64 {
        self.last_token
    }

    pub fn clock_ms(&self) -> u64 {
        self.clock_ms
    }

    fn tick(&mut self, now_ms: u64) -> u64 {
        self.clock_ms = self.clock_ms.max(now_ms);
        self.clock_ms
    }

    /// The live lease on `blob` at `now_ms`, if any.
    pub fn holder(&self, blob: BlobId, now_ms: u64) -> Option<&Lease> {
        let now = self.clock_ms.max(now_ms);
        self.by_blob.get(&blob).filter(|l| l.expires_ms > now)
    }

    /// `holder` asks for `blob` for `ttl_ms` (module header).
    pub fn acquire(
        &mut self,
        blob: BlobId,
        holder: &str,
        now_ms: u64,
        ttl_ms: u64,
        take_over: bool,
    ) -> Outcome {
        let now = self.tick(now_ms);
        let expires_ms = now.saturating_add(ttl_ms);
        if self.by_blob.len() >= LEASES_MAX && !self.by_blob.contains_key(&blob) {
            // Ended leases stay listed (a late renewal finds its holder
            // was taken over, not forgotten) until room is needed.
            self.by_blob.retain(|_, l| l.expires_ms > now);
        }
        let full = self.by_blob.len() >= LEASES_MAX;
        match self.by_blob.get_mut(&blob) {
            Some(l) if l.holder == holder => {
                l.expires_ms = l.expires_ms.max(expires_ms);
                return Outcome::Granted { token: l.token, expires_ms: l.expires_ms };
            }
            Some(l) if l.expires_ms > now && !take_over => {
                return Outcome::Held { holder: l.holder.clone(), expires_ms: l.expires_ms };
            }
            Some(_) => {}
            None if full => return Outcome::Full,
            None => {}
        }
        self.last_token += 1;
        let token = self.last_token;
        self.by_blob.insert(blob, Lease { holder: holder.to_string(), token, expires_ms });
        Outcome::Granted { token, expires_ms }
    }

    /// `holder` renews its lease on `blob` under `token` (module header).
    pub fn renew(&mut self, blob: BlobId, holder: &str, token: u64, now_ms: u64, ttl_ms: u64) -> Outcome {
        let now = self.tick(now_ms);
        match self.by_blob.get_mut(&blob) {
            Some(l) if l.token == token && l.holder == holder => {
                l.expires_ms = l.expires_ms.max(now.saturating_add(ttl_ms));
                Outcome::Granted { token, expires_ms: l.expires_ms }
            }
            Some(l) => Outcome::Lost { holder: Some(l.holder.clone()) },
            None => Outcome::Lost { holder: None },
        }
    }

    /// Frees `blob` if `token` still holds it; whether it did.
    pub fn release(&mut self, blob: BlobId, token: u64) -> bool {
        if self.by_blob.get(&blob).is_some_and(|l| l.token == token) {
            self.by_blob.remove(&blob);
            true
        } else {
            false
        }
    }

    /// A new leader took over at `now_ms` (its clock): every lease lasts
    /// at least `ttl_ms` from then, so one its predecessor granted or
    /// renewed just before is honoured whatever the two clocks say.
    pub fn extend_all(&mut self, now_ms: u64, ttl_ms: u64) {
        let now = self.tick(now_ms);
        let until = now.saturating_add(ttl_ms);
        for l in self.by_blob.values_mut() {
            l.expires_ms = l.expires_ms.max(until);
        }
    }

    /// Forgets leases that ended before `now_ms` (their tokens stay
    /// counted in `last_token`).
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let now = self.tick(now_ms);
        let before = self.by_blob.len();
        self.by_blob.retain(|_, l| l.expires_ms > now);
        before - self.by_blob.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const B: BlobId = BlobId(1);
    const TTL: u64 = 10_000;

    fn granted(o: Outcome) -> (u64, u64) {
        match o {
            Outcome::Granted { token, expires_ms } => (token, expires_ms),
            other => panic!("expected a grant, got {other:?}"),
        }
    }

    #[test]
    fn a_free_volume_is_granted_and_a_retry_gets_the_same_lease() {
        let mut l = Leases::default();
        let (t, e) = granted(l.acquire(B, "a", 1000, TTL, false));
        assert_eq!((t, e), (1, 11_000));
        assert_eq!(granted(l.acquire(B, "a", 2000, TTL, false)), (1, 12_000), "renewed, same token");
        assert_eq!(l.holder(B, 2000).map(|x| x.holder.as_str()), Some("a"));
    }

    #[test]
    fn a_second_holder_is_refused_until_the_lease_ends() {
        let mut l = Leases::default();
        granted(l.acquire(B, "a", 0, TTL, false));
        assert_eq!(
            l.acquire(B, "b", 5000, TTL, false),
            Outcome::Held { holder: "a".into(), expires_ms: TTL }
        );
        let (t, _) = granted(l.acquire(B, "b", TTL, TTL, false));
        assert_eq!(t, 2, "a new token once the lease has ended");
        assert_eq!(l.renew(B, "a", 1, TTL + 1, TTL), Outcome::Lost { holder: Some("b".into()) });
    }

    #[test]
    fn take_over_grants_a_newer_token_at_once() {
        let mut l = Leases::default();
        granted(l.acquire(B, "a", 0, TTL, false));
        let (t, _) = granted(l.acquire(B, "b", 1, TTL, true));
        assert_eq!(t, 2);
        assert!(matches!(l.renew(B, "a", 1, 2, TTL), Outcome::Lost { .. }));
    }

    #[test]
    fn an_expired_lease_not_taken_is_renewed_under_its_token() {
        let mut l = Leases::default();
        granted(l.acquire(B, "a", 0, TTL, false));
        assert_eq!(granted(l.renew(B, "a", 1, 3 * TTL, TTL)), (1, 4 * TTL));
    }

    #[test]
    fn release_frees_only_under_the_current_token() {
        let mut l = Leases::default();
        granted(l.acquire(B, "a", 0, TTL, false));
        assert!(!l.release(B, 7), "a stale token changes nothing");
        assert!(l.holder(B, 0).is_some());
        assert!(l.release(B, 1));
        assert_eq!(granted(l.acquire(B, "b", 1, TTL, false)).0, 2, "free at once, a newer token");
        assert_eq!(l.renew(B, "a", 1, 2, TTL), Outcome::Lost { holder: Some("b".into()) });
    }

    #[test]
    fn a_new_leader_honours_leases_whatever_its_clock() {
        let mut l = Leases::default();
        granted(l.acquire(B, "a", 50_000, TTL, false));
        // The new leader's clock reads earlier than the old one's.
        l.extend_all(40_000, TTL);
        assert_eq!(l.clock_ms(), 50_000, "time does not go back");
        assert_eq!(l.holder(B, 59_999).map(|x| x.expires_ms), Some(60_000));
        // ... or later: the lease lasts a term from the takeover.
        l.extend_all(70_000, TTL);
        assert_eq!(l.holder(B, 75_000).map(|x| x.expires_ms), Some(80_000));
    }

    #[test]
    fn expired_leases_are_forgotten_but_their_tokens_are_not() {
        let mut l = Leases::default();
        granted(l.acquire(B, "a", 0, TTL, false));
        granted(l.acquire(BlobId(2), "a", 0, 2 * TTL, false));
        assert_eq!(l.expire(TTL), 1);
        assert_eq!(l.iter().count(), 1);
        assert_eq!(granted(l.acquire(B, "b", TTL, TTL, false)).0, 3);
        let back = Leases::from_parts(l.iter().map(|(b, x)| (*b, x.clone())), 0, l.clock_ms());
        assert_eq!(back.last_token(), 3, "restored tokens are never handed out again");
    }

    proptest! {
        /// Whatever the requests: no holder is granted a volume another
        /// holds live (unless taking it over), tokens only grow, and no
        /// token is ever granted to two holders.
        #[test]
        fn one_holder_at_a_time_and_tokens_grow(
            reqs in proptest::collection::vec((0u8..4, 0u8..3, 0u8..2, 0u64..30_000, any::<bool>()), 1..200)
        ) {
            let mut l = Leases::default();
            let mut owner: BTreeMap<u64, (u8, u8)> = BTreeMap::new(); // token -> (holder, blob)
            let mut held: BTreeMap<(u8, u8), u64> = BTreeMap::new(); // (holder, blob) -> token
            for (kind, who, blob, at, take) in reqs {
                let (name, b) = (format!("h{who}"), BlobId(blob as u128));
                let now = l.clock_ms().max(at);
                let other_live = l.holder(b, now).is_some_and(|x| x.holder != name);
                let last = l.last_token();
                let o = match kind {
                    0 => l.acquire(b, &name, at, TTL, take),
                    1 => l.renew(b, &name, held.get(&(who, blob)).copied().unwrap_or(0), at, TTL),
                    2 => { l.release(b, held.get(&(who, blob)).copied().unwrap_or(0)); continue }
                    _ => { l.extend_all(at, TTL); continue }
                };
                if let Outcome::Granted { token, expires_ms } = o {
                    prop_assert!(!other_live || (kind == 0 && take), "granted over a live lease");
                    prop_assert!(expires_ms > now);
                    match owner.insert(token, (who, blob)) {
                        Some(prev) => prop_assert_eq!(prev, (who, blob), "token {} granted to two", token),
                        None => prop_assert_eq!(token, last + 1, "a new token is the next one"),
                    }
                    held.insert((who, blob), token);
                }
            }
        }
    }
}
