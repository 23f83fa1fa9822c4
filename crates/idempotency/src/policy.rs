//! Which responses are terminal, and so stored and replayed.

/// Decides which response statuses are terminal (stored and replayed) and which are not (the
/// record is marked failed and the next retry runs the handler again).
///
/// The rule from the design: store a response if and only if the server made a durable state
/// change, or decided that no state change will ever happen for this request.
///
/// ```
/// use idempotency::ResponsePolicy;
///
/// let p = ResponsePolicy::default();
/// assert!(p.is_terminal(201) && p.is_terminal(409) && p.is_terminal(422));
/// assert!(!p.is_terminal(503) && !p.is_terminal(429) && !p.is_terminal(401));
/// assert!(!p.clone().without(422).is_terminal(422));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponsePolicy {
    terminal_4xx: Vec<u16>,
}

/// The 4xx statuses stored by default: permanent decisions about the request.
pub const DEFAULT_TERMINAL_4XX: [u16; 8] = [400, 404, 405, 409, 410, 413, 415, 422];

/// Statuses never stored, whatever the configuration: they mean "try again" or "not you".
pub const NEVER_STORED: [u16; 5] = [401, 403, 408, 425, 429];

impl Default for ResponsePolicy {
    fn default() -> Self {
        Self { terminal_4xx: DEFAULT_TERMINAL_4XX.to_vec() }
    }
}

impl ResponsePolicy {
    /// Also stores `status` (a 4xx). 5xx and the [`NEVER_STORED`] statuses cannot be added.
    pub fn with(mut self, status: u16) -> Self {
        if (400..500).contains(&status) && !NEVER_STORED.contains(&status) && !self.terminal_4xx.contains(&status) {
            self.terminal_4xx.push(status);
        }
        self
    }

    /// Stops storing `status` (a 4xx): such responses are not replayed and the retry runs again.
    pub fn without(mut self, status: u16) -> Self {
        self.terminal_4xx.retain(|s| *s != status);
        self
    }

    /// True when a response with `status` is stored and replayed.
    pub fn is_terminal(&self, status: u16) -> bool {
        match status {
            200..=299 => true,
            400..=499 => !NEVER_STORED.contains(&status) && self.terminal_4xx.contains(&status),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_spec() {
        let p = ResponsePolicy::default();
        for s in [200, 201, 202, 204, 299, 400, 404, 405, 409, 410, 413, 415, 422] {
            assert!(p.is_terminal(s), "{s} should be stored");
        }
        for s in [100, 301, 304, 401, 403, 408, 425, 429, 500, 502, 503, 504, 418] {
            assert!(!p.is_terminal(s), "{s} should not be stored");
        }
    }

    #[test]
    fn never_stored_cannot_be_added() {
        let p = ResponsePolicy::default().with(429).with(503).with(418);
        assert!(!p.is_terminal(429));
        assert!(!p.is_terminal(503));
        assert!(p.is_terminal(418));
    }
}
