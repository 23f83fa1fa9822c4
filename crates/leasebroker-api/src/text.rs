//! What a terminal or a page must not show as it is: text from a tenant (a label, an image) may
//! carry controls that move the cursor or ring the bell, and bidirectional overrides that make
//! the text around them read in another order (a file name `gpj.exe` shown as `exe.jpg`). Both
//! `lbctl` and the service's console write such characters as visible `\uXXXX` escapes.
//!
//! ```
//! use leasebroker_api::text::{escape_unsafe, is_bidi_control};
//! assert!(is_bidi_control('\u{202e}'));
//! assert_eq!(escape_unsafe("\u{202e}gpj.exe\u{7}"), "\\u202egpj.exe\\u0007");
//! ```

/// Whether `c` is a bidirectional formatting character: the marks, embeddings, overrides and
/// isolates of Unicode's bidirectional algorithm.
pub fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Whether `c` is written as an escape: a control character other than newline and tab, or a
/// bidirectional formatting character.
pub fn needs_escape(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || is_bidi_control(c)
}

/// `text` with every character [`needs_escape`] says written as `\uXXXX` (four lowercase hex
/// digits), the rest as it is.
pub fn escape_unsafe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if needs_escape(c) {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}
