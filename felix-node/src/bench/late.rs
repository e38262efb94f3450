//! `bench --late-reader`: a reader that starts far behind the publishers and reports when it
//! caught up with the live records.

use super::*;

/// `--late-reader`: a subscriber that starts `behind` records behind the tail while the
/// publishers go on, and how it fares.
pub(super) struct LateReader {
    pub(super) stream: String,
    /// The offset of the first record the publishers sent.
    pub(super) next: u64,
    pub(super) behind: u64,
    /// The publishers' clock (send times ride in each record's first 8 bytes).
    pub(super) epoch: Instant,
}

/// What [`LateReader`] measured.
pub(super) struct LateReport {
    pub(super) behind: u64,
    pub(super) start_offset: u64,
    /// Records it read.
    pub(super) read: u64,
    /// Records retention removed before it got to them.
    pub(super) skipped: u64,
    /// Seconds from its subscribe to the first record it got within [`LIVE`] of being sent.
    pub(super) caught_up_after: Option<f64>,
    /// Records it read until it caught up (or until the run ended).
    pub(super) read_catching_up: u64,
    /// Seconds it read for.
    pub(super) secs: f64,
    pub(super) resumed: u64,
    /// Publish-to-delivery time of the last record it got, seconds.
    pub(super) last_age: f64,
}

/// A record delivered this soon after it was sent is live: the reader has caught up.
pub(super) const LIVE: Duration = Duration::from_millis(250);

impl LateReader {
    pub(super) async fn run(
        self,
        c: Client,
        published: Arc<AtomicU64>,
        mut ended: tokio::sync::watch::Receiver<bool>,
    ) -> Result<LateReport, String> {
        use felix_proto::message::StartPosition;
        loop {
            if published.load(Ordering::Relaxed) >= self.behind {
                break;
            }
            if *ended.borrow() {
                return Err(format!(
                    "the run ended before {} records were published for --late-reader: give a longer --duration or \
                     a smaller --late-reader",
                    self.behind
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The publishers' count runs a little ahead of what the broker appended (unacked batches
        // in flight), so the reader starts at most that little less far behind.
        let start_offset = (self.next + published.load(Ordering::Relaxed)).saturating_sub(self.behind).max(self.next);
        let started = Instant::now();
        let mut sub = c
            .subscribe("bench", &self.stream, Some(StartPosition::Offset(start_offset)), None)
            .await
            .map_err(|e| format!("late reader: {e}"))?;
        let mut cursor = felix_proto::client::SubscriptionCursor::new();
        cursor.subscribed(sub.start_offset);
        let mut r = LateReport {
            behind: self.behind,
            start_offset,
            read: 0,
            skipped: 0,
            caught_up_after: None,
            read_catching_up: 0,
            secs: 0.0,
            resumed: 0,
            last_age: 0.0,
        };
        let mut expect = start_offset;
        loop {
            let item = tokio::select! {
                item = sub.next() => item,
                _ = ended.wait_for(|d| *d) => None,
            };
            if let Some(SubscriptionItem::End(reason @ felix_proto::client::EndReason::Lagged { .. })) = item {
                let Some(start) = cursor.resume(&reason) else { break };
                sub = c
                    .subscribe("bench", &self.stream, Some(start), None)
                    .await
                    .map_err(|e| format!("late reader, resuming: {e}"))?;
                cursor.subscribed(sub.start_offset);
                r.resumed += 1;
                continue;
            }
            let Some(SubscriptionItem::Events(b)) = item else { break };
            cursor.delivered(&b);
            let n = u64::from(b.records.count());
            if let Some(base) = b.base_offset {
                r.skipped += base.saturating_sub(expect);
                expect = base + n;
            }
            r.read += n;
            if let Some(p) = b.records.slices().last().filter(|p| p.len() >= 8) {
                let mut ts = [0u8; 8];
                ts.copy_from_slice(&p[..8]);
                let age = (self.epoch.elapsed().as_nanos() as u64).saturating_sub(u64::from_be_bytes(ts));
                r.last_age = age as f64 / 1e9;
                if r.caught_up_after.is_none() && Duration::from_nanos(age) < LIVE {
                    r.caught_up_after = Some(started.elapsed().as_secs_f64());
                    r.read_catching_up = r.read;
                }
            }
        }
        r.secs = started.elapsed().as_secs_f64();
        if r.caught_up_after.is_none() {
            r.read_catching_up = r.read;
        }
        drop(c);
        Ok(r)
    }
}

impl LateReport {
    /// Records per second while it was behind.
    pub(super) fn catch_up_rate(&self) -> f64 {
        self.read_catching_up as f64 / self.caught_up_after.unwrap_or(self.secs).max(1e-9)
    }

    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "behind": self.behind, "start_offset": self.start_offset, "read": self.read,
            "skipped_by_retention": self.skipped, "caught_up_after_s": self.caught_up_after,
            "read_per_s_while_behind": self.catch_up_rate(), "read_for_s": self.secs,
            "resumed_after_lag": self.resumed, "last_record_age_s": self.last_age,
        })
    }

    pub(super) fn print(&self) {
        out!("Late reader, started {} records behind (offset {}):", self.behind, self.start_offset);
        out!("  {:<28} {:>14}", "read", self.read);
        out!("  {:<28} {:>14.0}", "records/s while behind", self.catch_up_rate());
        out!("  {:<28} {:>14}", "skipped (retention)", self.skipped);
        match self.caught_up_after {
            Some(s) => out!("  {:<28} {:>13.2}s", "caught up after", s),
            None => out!("  {:<28} {:>14}", "caught up", format!("no: {:.1}s behind at the end", self.last_age)),
        }
    }
}
