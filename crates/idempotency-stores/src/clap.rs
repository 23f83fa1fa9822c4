//! A clap value parser for URLs that may carry secrets: [`UrlParser`].

use std::ffi::OsStr;
use std::fmt::Display;
use std::marker::PhantomData;
use std::str::FromStr;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;

/// Parses a flag's value with `T::from_str` and, on failure, gives a usage error (exit 2) that is
/// one line, `--FLAG: ERROR`, and never quotes the value itself: clap's own message for a failed
/// parser repeats the value, which for a URL may hold a password. `T`'s error should show the
/// value [redacted](crate::redact), as [`StoreUrl`](crate::StoreUrl)'s does.
///
/// ```
/// use clap::Parser;
/// use idempotency_stores::StoreUrl;
/// use idempotency_stores::clap::UrlParser;
///
/// #[derive(Parser)]
/// struct Args {
///     #[arg(long, value_parser = UrlParser::<StoreUrl>::new())]
///     record_store: StoreUrl,
/// }
///
/// let err = Args::try_parse_from(["app", "--record-store", "mysql://u:secret@h/db"]).err().unwrap();
/// assert_eq!(err.exit_code(), 2);
/// assert!(err.to_string().starts_with("error: --record-store: unsupported store URL"));
/// assert!(!err.to_string().contains("secret"));
/// ```
#[derive(Debug)]
pub struct UrlParser<T>(PhantomData<fn() -> T>);

impl<T> UrlParser<T> {
    /// The parser.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T> Default for UrlParser<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for UrlParser<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> TypedValueParser for UrlParser<T>
where
    T: FromStr + Clone + Send + Sync + 'static,
    T::Err: Display,
{
    type Value = T;

    fn parse_ref(&self, _: &clap::Command, arg: Option<&clap::Arg>, value: &OsStr) -> Result<T, clap::Error> {
        let flag = arg.and_then(clap::Arg::get_long).map_or_else(|| "the value".to_owned(), |l| format!("--{l}"));
        let fail = |message: String| clap::Error::raw(ErrorKind::ValueValidation, format!("{flag}: {message}\n"));
        let value = value.to_str().ok_or_else(|| fail("not valid UTF-8 (the value is not shown)".to_owned()))?;
        value.parse().map_err(|e: T::Err| fail(e.to_string().replace('\n', " ")))
    }
}
