//! `TextStream`: a request's output text, built token by token: incremental detokenization (the
//! text a token adds, held back while it ends in an incomplete character), and stop strings
//! (the text stops right before the first one; text that may be the start of one is held back
//! until it is known not to be).
//!
//! Incremental decoding follows the usual scheme: decode the last few tokens with and without
//! the new one and emit the difference, so the cost per token does not grow with the output and
//! tokenizers that merge across token boundaries (byte-level BPE, SentencePiece spaces) still
//! give the right text.
//!
//! The module is private; `TextStream` reaches outside the crate only through the hidden
//! `bench_internals` module, for the crate's benchmarks.

/// See the module header.
#[derive(Debug, Clone, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// `ids[prefix..read]` were decoded last time as the context of the new tokens.
    prefix: usize,
    read: usize,
    /// The text so far.
    text: String,
    /// Bytes of `text` already handed out as deltas.
    sent: usize,
    stop_strings: Vec<String>,
    /// Where the first stop string found begins.
    stop_at: Option<usize>,
}

impl TextStream {
    /// An empty stream whose text ends before the first of `stop_strings` (none: never).
    pub fn new(stop_strings: Vec<String>) -> TextStream {
        TextStream {
            stop_strings,
            ..TextStream::default()
        }
    }

    /// Whether a stop string has been found.
    pub fn stopped(&self) -> bool {
        self.stop_at.is_some()
    }

    /// Add a token; returns the text it releases. `last`: the output ends with this token, so
    /// nothing is held back any more.
    pub fn push(&mut self, token: u32, last: bool, decode: impl Fn(&[u32]) -> String) -> String {
        self.ids.push(token);
        if self.stop_at.is_some() {
            return String::new();
        }
        let before = self.text.len();
        let context = decode(&self.ids[self.prefix..self.read]);
        let full = decode(&self.ids[self.prefix..]);
        // An incomplete character may complete with the next token, unless there is none.
        if full.len() > context.len()
            && (last || !full.ends_with('\u{FFFD}'))
            && full.starts_with(context.as_str())
        {
            self.text.push_str(&full[context.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        let longest = self.stop_strings.iter().map(String::len).max().unwrap_or(0);
        let from =
            floor_char_boundary(&self.text, before.saturating_sub(longest.saturating_sub(1)));
        let found = self
            .stop_strings
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        let end = match found {
            Some(at) => {
                self.stop_at = Some(at);
                at
            }
            None if last => self.text.len(),
            None => self.text.len() - self.held_back(),
        };
        let end = end.max(self.sent);
        let delta = self.text[self.sent..end].to_string();
        self.sent = end;
        delta
    }

    /// The output text: up to the stop string when one was found, else `full` (the decode of
    /// every token at once).
    pub fn final_text(&self, full: Option<String>) -> Option<String> {
        match self.stop_at {
            Some(at) => Some(self.text[..at].to_string()),
            None => full,
        }
    }

    /// Bytes at the end of the text that could be the start of a stop string.
    fn held_back(&self) -> usize {
        let mut keep = 0;
        for s in &self.stop_strings {
            for (k, _) in s.char_indices().skip(1) {
                if k > keep && self.text.ends_with(&s[..k]) {
                    keep = k;
                }
            }
        }
        keep
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy tokenizer: id `i` is the i-th piece; ids 100.. are the two halves of "é".
    fn decode(ids: &[u32]) -> String {
        let pieces = ["", "Hel", "lo", " wor", "ld", "!", " S", "TOP", " more"];
        let mut bytes = Vec::new();
        for &i in ids {
            match i {
                100 => bytes.push(0xC3),
                101 => bytes.push(0xA9),
                _ => bytes.extend_from_slice(pieces[i as usize].as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn run(stream: &mut TextStream, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .enumerate()
            .map(|(i, &t)| stream.push(t, i + 1 == ids.len(), decode))
            .collect()
    }

    #[test]
    fn deltas_add_up_to_the_text_and_wait_for_whole_characters() {
        let mut s = TextStream::new(Vec::new());
        let d = run(&mut s, &[1, 2, 100, 101, 3]);
        assert_eq!(d, vec!["Hel", "lo", "", "é", " wor"]);
        assert_eq!(
            s.final_text(Some(decode(&[1, 2, 100, 101, 3]))).as_deref(),
            Some("Helloé wor")
        );
    }

    #[test]
    fn a_stop_string_across_tokens_cuts_the_text_and_is_never_shown() {
        let mut s = TextStream::new(vec![" STOP".into()]);
        let d = run(&mut s, &[1, 2, 6, 7, 8]);
        // " S" may start " STOP": held back; "TOP" completes it; nothing after it is shown.
        assert_eq!(d, vec!["Hel", "lo", "", "", ""]);
        assert!(s.stopped());
        assert_eq!(s.final_text(None).as_deref(), Some("Hello"));
    }

    #[test]
    fn held_back_text_is_released_when_it_turns_out_not_to_stop() {
        let mut s = TextStream::new(vec![" STOP".into(), "ld!!".into()]);
        let d = run(&mut s, &[3, 6, 4, 5]);
        assert_eq!(d, vec![" wor", "", " S", "ld!"]);
        assert!(!s.stopped());
    }
}
