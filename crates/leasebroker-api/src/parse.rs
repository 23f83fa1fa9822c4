//! How every tool of the project reads durations and probabilities from its command line and
//! environment (`leasebroker`, `lbctl`, `faultline`): one parser each, so a value means the same
//! to all of them.

use std::time::Duration;

/// A duration as `500ms`, `10s`, `5m`, `1h30m`, `7d` (humantime's syntax), or a bare number of
/// seconds. Surrounding whitespace is ignored.
///
/// ```
/// use std::time::Duration;
/// use leasebroker_api::parse::duration;
/// assert_eq!(duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
/// assert_eq!(duration(" 30 "), Ok(Duration::from_secs(30)));
/// assert!(duration("soon").is_err());
/// ```
pub fn duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 500ms, 10s, 5m, 7d)"))
}

/// Like [`duration`], but zero is refused.
pub fn positive_duration(s: &str) -> Result<Duration, String> {
    match duration(s)? {
        d if d.is_zero() => Err("must be more than zero".to_owned()),
        d => Ok(d),
    }
}

/// A probability from 0 to 1 (`0`, `0.05`, `1`). Surrounding whitespace is ignored; anything
/// else (a negative number, more than 1, `NaN`) is refused.
///
/// ```
/// use leasebroker_api::parse::probability;
/// assert_eq!(probability("0.05"), Ok(0.05));
/// assert!(probability("1.5").is_err());
/// assert!(probability("NaN").is_err());
/// ```
pub fn probability(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("expected a probability from 0 to 1, got {s:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_the_same_everywhere() {
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(duration("0"), Ok(Duration::ZERO));
        assert!(duration("").is_err());
        assert!(duration("-1s").is_err());
        assert!(duration("10 parsecs").unwrap_err().contains("examples"));
        assert_eq!(positive_duration("1s"), Ok(Duration::from_secs(1)));
        assert!(positive_duration("0s").is_err());
    }

    #[test]
    fn probabilities_are_from_zero_to_one() {
        for ok in ["0", "1", "0.5", " 0.25 ", "1e-3"] {
            assert!(probability(ok).is_ok(), "{ok}");
        }
        for bad in ["-0.1", "1.01", "NaN", "inf", "", "half"] {
            assert!(probability(bad).is_err(), "{bad}");
        }
    }
}
