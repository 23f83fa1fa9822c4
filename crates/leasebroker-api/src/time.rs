//! Timestamps as the service writes them: RFC 3339 in UTC with `Z` and exactly six fractional
//! digits (`2026-11-30T21:00:00.500000Z`). Any RFC 3339 timestamp reads back.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Deserializer, Serializer};

fn parse<'de, D: Deserializer<'de>>(text: &str) -> Result<DateTime<Utc>, D::Error> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| serde::de::Error::custom(format_args!("not an RFC 3339 timestamp: {e}")))
}

/// `#[serde(with = "micros")]` for a `DateTime<Utc>`.
pub(crate) mod micros {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&t.to_rfc3339_opts(SecondsFormat::Micros, true))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
        parse::<D>(&String::deserialize(d)?)
    }
}

/// `#[serde(with = "option_micros")]` for an `Option<DateTime<Utc>>`: `null` is `None`.
pub(crate) mod option_micros {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
        match t {
            Some(t) => super::micros::serialize(t, s),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DateTime<Utc>>, D::Error> {
        Option::<String>::deserialize(d)?.map(|text| parse::<D>(&text)).transpose()
    }
}
