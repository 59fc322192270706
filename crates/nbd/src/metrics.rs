//! What `GET /metrics` shows of a server's open exports
//! ([`crate::NbdConfig::metrics_listen`]): every export's size, and for an
//! S3 volume (design 0008) what an operator needs while it is served: the
//! bytes acknowledged but not yet in the object store (what dies with the
//! cache disk), the cache's use, the objects, and every request sent to the
//! object store; and, for the whole server, TLS handshakes and the clients
//! it refused ([`Guard`]). [`render`] is pure; the server gathers
//! [`Figures`] on each request.

use std::sync::atomic::{AtomicU64, Ordering};

use blizzard_env::admission::AdmissionCounts;
use blizzard_lsvd::store::CountsNow;
use blizzard_lsvd::Info;
use blizzard_metrics::Text;
use blizzard_volume::Volume;

/// One open export's numbers at one moment.
#[derive(Clone, Debug)]
pub(crate) struct Figures {
    pub(crate) export: String,
    pub(crate) size: u64,
    /// An S3 volume's own figures and its object-store request counts.
    pub(crate) s3: Option<(Info, CountsNow)>,
}

impl Figures {
    pub(crate) fn of(export: &str, v: &Volume) -> Figures {
        Figures { export: export.to_string(), size: v.size(), s3: v.lsvd_info().zip(v.lsvd_counts()) }
    }
}

/// What the server's security checks did, counted since it started.
#[derive(Debug, Default)]
pub(crate) struct Guard {
    tls_ok: AtomicU64,
    tls_failed: AtomicU64,
    tls_required: AtomicU64,
    access_denied: AtomicU64,
}

/// Something [`Guard`] counts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Checked {
    /// A TLS handshake completed.
    TlsOk,
    /// A TLS handshake failed or timed out (a refused certificate, garbage).
    TlsFailed,
    /// An option refused because TLS is required and the client had not
    /// upgraded.
    TlsRequired,
    /// An export refused by its access list.
    AccessDenied,
}

/// [`Guard`]'s counts at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct GuardNow {
    pub(crate) tls_ok: u64,
    pub(crate) tls_failed: u64,
    pub(crate) tls_required: u64,
    pub(crate) access_denied: u64,
}

impl Guard {
    pub(crate) fn count(&self, what: Checked) {
        let c = match what {
            Checked::TlsOk => &self.tls_ok,
            Checked::TlsFailed => &self.tls_failed,
            Checked::TlsRequired => &self.tls_required,
            Checked::AccessDenied => &self.access_denied,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn now(&self) -> GuardNow {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        GuardNow {
            tls_ok: g(&self.tls_ok),
            tls_failed: g(&self.tls_failed),
            tls_required: g(&self.tls_required),
            access_denied: g(&self.access_denied),
        }
    }
}

/// One family with a sample per export: a counter if its name ends in
/// `_total` (the Prometheus convention), else a gauge.
fn per_export(t: &mut Text, name: &str, help: &str, samples: &[(&str, u64)]) {
    let labels: Vec<[(&str, &str); 1]> = samples.iter().map(|(e, _)| [("export", *e)]).collect();
    let s: Vec<(&[(&str, &str)], f64)> =
        labels.iter().zip(samples).map(|(l, (_, v))| (&l[..], *v as f64)).collect();
    if name.ends_with("_total") {
        t.counters(name, help, &s);
    } else {
        t.gauges(name, help, &s);
    }
}

/// The text exposition of `exports`, of the server's checks and of its
/// negotiating connections (`pending`: `blizzard_env::admission`), one
/// family per figure.
pub(crate) fn render(exports: &[Figures], guard: GuardNow, pending: AdmissionCounts) -> String {
    let mut t = Text::new();
    t.gauge("blizzard_nbd_exports_open", "Exports this server has open.", exports.len() as f64);
    t.gauge(
        "blizzard_nbd_negotiating_connections",
        "Connections still negotiating (not yet serving an export).",
        pending.pending as f64,
    );
    let evicted: &[(&str, &str)] = &[("reason", "evicted")];
    let timed_out: &[(&str, &str)] = &[("reason", "timed_out")];
    t.counters(
        "blizzard_nbd_negotiations_dropped_total",
        "Negotiations given up: evicted (too many pending; the oldest silent one goes) or timed out.",
        &[(evicted, pending.evicted as f64), (timed_out, pending.timed_out as f64)],
    );
    let ok: &[(&str, &str)] = &[("result", "ok")];
    let failed: &[(&str, &str)] = &[("result", "failed")];
    t.counters(
        "blizzard_nbd_tls_handshakes_total",
        "TLS handshakes after STARTTLS, by result (failed: a refused certificate, garbage, a timeout).",
        &[(ok, guard.tls_ok as f64), (failed, guard.tls_failed as f64)],
    );
    let tls: &[(&str, &str)] = &[("reason", "tls_required")];
    let access: &[(&str, &str)] = &[("reason", "access_list")];
    t.counters(
        "blizzard_nbd_refused_total",
        "Options refused: before a required TLS upgrade, or by an export's access list.",
        &[(tls, guard.tls_required as f64), (access, guard.access_denied as f64)],
    );
    let sizes: Vec<(&str, u64)> = exports.iter().map(|f| (f.export.as_str(), f.size)).collect();
    per_export(&mut t, "blizzard_nbd_export_size_bytes", "Size of each open export.", &sizes);
    let s3: Vec<(&str, &Info, &CountsNow)> =
        exports.iter().filter_map(|f| f.s3.as_ref().map(|(i, c)| (f.export.as_str(), i, c))).collect();
    if s3.is_empty() {
        return t.finish();
    }
    let figure =
        |get: fn(&Info) -> u64| -> Vec<(&str, u64)> { s3.iter().map(|(e, i, _)| (*e, get(i))).collect() };
    per_export(
        &mut t,
        "blizzard_lsvd_not_in_object_store_bytes",
        "Bytes acknowledged but not yet in the object store: lost if the cache disk dies (the volume then comes back as the objects' prefix).",
        &figure(|i| i.dirty_bytes),
    );
    per_export(
        &mut t,
        "blizzard_lsvd_cache_used_bytes",
        "Bytes of the cache journal in use.",
        &figure(|i| i.cache_used),
    );
    per_export(&mut t, "blizzard_lsvd_cache_bytes", "Size of the cache journal.", &figure(|i| i.cache_len));
    per_export(&mut t, "blizzard_lsvd_objects", "Data objects in the volume's log.", &figure(|i| i.objects));
    per_export(&mut t, "blizzard_lsvd_live_bytes", "Live data bytes in objects.", &figure(|i| i.live_bytes));
    per_export(
        &mut t,
        "blizzard_lsvd_stored_bytes",
        "Data bytes stored in objects, live or not (cleaning starts below 70% live).",
        &figure(|i| i.stored_bytes),
    );
    let kinds = |c: &CountsNow| [("put", c.puts), ("get", c.gets), ("delete", c.deletes), ("list", c.lists)];
    let labels: Vec<[(&str, &str); 2]> =
        s3.iter().flat_map(|(e, _, c)| kinds(c).map(|(k, _)| [("export", *e), ("kind", k)])).collect();
    let values: Vec<u64> = s3.iter().flat_map(|(_, _, c)| kinds(c).map(|(_, n)| n)).collect();
    let samples: Vec<(&[(&str, &str)], f64)> =
        labels.iter().zip(&values).map(|(l, n)| (&l[..], *n as f64)).collect();
    t.counters(
        "blizzard_lsvd_object_store_requests_total",
        "Requests sent to the object store, by kind.",
        &samples,
    );
    let put: Vec<(&str, u64)> = s3.iter().map(|(e, _, c)| (*e, c.bytes_put)).collect();
    per_export(&mut t, "blizzard_lsvd_object_store_put_bytes_total", "Bytes put to the object store.", &put);
    per_export(
        &mut t,
        "blizzard_lsvd_read_cache_hits_total",
        "Reads of object data served by the local read cache.",
        &figure(|i| i.read_cache.hits),
    );
    per_export(
        &mut t,
        "blizzard_lsvd_read_cache_misses_total",
        "Reads of object data the read cache did not hold (fetched from the object store).",
        &figure(|i| i.read_cache.misses),
    );
    per_export(
        &mut t,
        "blizzard_lsvd_read_cache_lines",
        "64 KiB lines of object data in the read cache.",
        &figure(|i| i.read_cache.lines),
    );
    t.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(dirty: u64) -> Info {
        Info {
            name: "v".into(),
            uuid: 1,
            size: 1 << 30,
            head: 9,
            epoch: 2,
            dirty_bytes: dirty,
            cache_used: 4096,
            cache_len: 1 << 20,
            live_bytes: 700,
            stored_bytes: 1000,
            objects: 3,
            map_extents: 5,
            recovered_checkpoint: 0,
            rolled: 0,
            replayed: 0,
            read_cache: blizzard_lsvd::CacheStats {
                hits: 11,
                misses: 4,
                bad: 0,
                lines: 4,
                capacity_lines: 16,
            },
        }
    }

    #[test]
    fn a_blob_volume_shows_only_its_size() {
        let text = render(
            &[Figures { export: "disk".into(), size: 4096, s3: None }],
            GuardNow::default(),
            Default::default(),
        );
        assert!(text.contains("blizzard_nbd_exports_open 1\n"), "{text}");
        assert!(text.contains("blizzard_nbd_export_size_bytes{export=\"disk\"} 4096\n"), "{text}");
        assert!(!text.contains("lsvd"), "{text}");
        // The server's checks, zero until something happens.
        assert!(text.contains("blizzard_nbd_tls_handshakes_total{result=\"ok\"} 0\n"), "{text}");
    }

    #[test]
    fn the_guard_counts_each_check() {
        let g = Guard::default();
        for c in
            [Checked::TlsOk, Checked::TlsOk, Checked::TlsFailed, Checked::TlsRequired, Checked::AccessDenied]
        {
            g.count(c);
        }
        let now = g.now();
        assert_eq!(now, GuardNow { tls_ok: 2, tls_failed: 1, tls_required: 1, access_denied: 1 });
        let pending = AdmissionCounts { admitted: 9, evicted: 3, timed_out: 2, pending: 4 };
        let text = render(&[], now, pending);
        assert!(text.contains("blizzard_nbd_negotiating_connections 4\n"), "{text}");
        assert!(text.contains("blizzard_nbd_negotiations_dropped_total{reason=\"evicted\"} 3\n"), "{text}");
        assert!(text.contains("blizzard_nbd_negotiations_dropped_total{reason=\"timed_out\"} 2\n"), "{text}");
        assert!(text.contains("blizzard_nbd_tls_handshakes_total{result=\"ok\"} 2\n"), "{text}");
        assert!(text.contains("blizzard_nbd_tls_handshakes_total{result=\"failed\"} 1\n"), "{text}");
        assert!(text.contains("blizzard_nbd_refused_total{reason=\"tls_required\"} 1\n"), "{text}");
        assert!(text.contains("blizzard_nbd_refused_total{reason=\"access_list\"} 1\n"), "{text}");
    }

    #[test]
    fn an_s3_volume_shows_what_the_cache_risks_and_its_requests() {
        let counts = CountsNow {
            puts: 7,
            gets: 2,
            deletes: 1,
            lists: 0,
            bytes_put: 1 << 20,
            bytes_got: 0,
            ..CountsNow::default()
        };
        let text = render(
            &[
                Figures { export: "a".into(), size: 1, s3: None },
                Figures { export: "s".into(), size: 1 << 30, s3: Some((info(12288), counts)) },
            ],
            GuardNow::default(),
            AdmissionCounts::default(),
        );
        assert!(text.contains("blizzard_nbd_exports_open 2\n"), "{text}");
        assert!(text.contains("blizzard_lsvd_not_in_object_store_bytes{export=\"s\"} 12288\n"), "{text}");
        assert!(
            text.contains("blizzard_lsvd_object_store_requests_total{export=\"s\",kind=\"put\"} 7\n"),
            "{text}"
        );
        assert!(
            text.contains("blizzard_lsvd_object_store_requests_total{export=\"s\",kind=\"delete\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("blizzard_lsvd_object_store_put_bytes_total{export=\"s\"} 1048576\n"),
            "{text}"
        );
        assert!(text.contains("blizzard_lsvd_read_cache_hits_total{export=\"s\"} 11\n"), "{text}");
        assert!(text.contains("blizzard_lsvd_read_cache_misses_total{export=\"s\"} 4\n"), "{text}");
        assert!(!text.contains("lsvd_objects{export=\"a\"}"), "{text}");
        // Each family is announced once, before its samples.
        for family in ["blizzard_lsvd_objects", "blizzard_lsvd_object_store_requests_total"] {
            assert_eq!(text.matches(&format!("# TYPE {family} ")).count(), 1, "{text}");
        }
    }
}
