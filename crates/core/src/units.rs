//! Byte sizes as operators type them: `8MiB`, `4G`, `512k`, `1048576`.
//! Suffixes are binary (K = KiB = 1024) because disks and tracts are.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid size {0:?}: use a number with an optional K, M, G or T suffix (binary), e.g. 8MiB or 4G")]
pub struct ParseSizeError(String);

/// Parses a byte size with an optional binary suffix.
pub fn parse_size(s: &str) -> Result<u64, ParseSizeError> {
    let err = || ParseSizeError(s.to_string());
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| err())?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(err()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(err)
}

/// Formats a byte count for people: `8.0 MiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8MiB"), Ok(8 << 20));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(format_size(8 << 20), "8.0 MiB");
        assert_eq!(format_size(10), "10 B");
    }
}
