//! What the broker task reports: the Prometheus page and the cluster status.

use super::*;

impl BrokerTask {
    /// `GET /cluster` on the metrics listener: members, leader, every shard's owner and
    /// generation, as JSON (`{"cluster":false}` for a single broker); one page of it with
    /// `?limit=N&after=CURSOR` (D55).
    pub(super) fn cluster_status(&self) -> String {
        self.cluster_status_page(None)
    }

    pub(super) fn cluster_status_page(&self, page: Option<&felix_proto::cluster::status::StatusPage>) -> String {
        let Node::Cluster(n) = &self.node else { return "{\"cluster\":false}\n".into() };
        // Serialised straight to text (no JSON value built first: at 10,000 shards that was
        // most of a render's cost, on the broker's task).
        let mut text = String::from_utf8(n.status_page_json(None, page)).unwrap_or_default();
        text.push('\n');
        text
    }

    /// Prometheus text exposition of the broker's and the driver's counters.
    pub(super) fn metrics(&self) -> String {
        use std::fmt::Write;
        let st = self.node.broker_ref().stats();
        let mut out = String::new();
        let mut m = |name: &str, kind: &str, help: &str, value: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        m(
            "felix_connections_open",
            "gauge",
            "Open client connections.",
            self.node.broker_ref().connection_count() as u64,
        );
        m("felix_connections_total", "counter", "Client connections accepted.", st.connections_opened);
        m(
            "felix_publishes_rate_limited_total",
            "counter",
            "Publishes refused (or, unacked, dropped) for their tenant's publish rate limit.",
            st.publishes_rate_limited,
        );
        m(
            "felix_publishes_forwarded_total",
            "counter",
            "Publishes forwarded to the owner of their shard (a cluster).",
            st.publishes_forwarded,
        );
        m(
            "felix_publishes_forwarded_in_total",
            "counter",
            "Publishes other brokers of the cluster forwarded here.",
            st.publishes_forwarded_in,
        );
        m(
            "felix_requests_forwarded_total",
            "counter",
            "Cache and counter requests forwarded to the owner of their cache.",
            st.requests_forwarded,
        );
        m(
            "felix_requests_forwarded_in_total",
            "counter",
            "Cache and counter requests other brokers forwarded here.",
            st.requests_forwarded_in,
        );
        m(
            "felix_unauthenticated_connections",
            "gauge",
            "Connections none of whose streams authenticated yet.",
            self.node.broker_ref().unauthenticated_connections() as u64,
        );
        m(
            "felix_connections_refused_total",
            "counter",
            "Connections refused in the handshake: too many unauthenticated ones (in all or from one address).",
            st.connections_refused,
        );
        m(
            "felix_connections_evicted_total",
            "counter",
            "Unauthenticated connections closed to make room for new ones.",
            st.connections_evicted,
        );
        m(
            "felix_auth_timeouts_total",
            "counter",
            "Control streams ended for not authenticating in time.",
            st.auth_timeouts,
        );
        m("felix_subscriptions", "gauge", "Live subscriptions.", self.node.broker_ref().subscription_count() as u64);
        // Leak detectors: each must come back down when clients go away.
        m(
            "felix_control_streams",
            "gauge",
            "Control streams the broker holds.",
            self.node.broker_ref().control_stream_count() as u64,
        );
        m("felix_driver_connections", "gauge", "Connections the driver holds.", self.conns.len() as u64);
        // QUIC's own view of the open connections: what a record costs in datagrams, system
        // calls and acknowledgements, and whether the path MTU holds (a collapse to 1200 is the
        // black-hole detector reacting to a burst of lost full-size packets).
        let stats: Vec<quinn::ConnectionStats> = self.conns.values().map(|c| c.quic.stats()).collect();
        let sum = |f: fn(&quinn::ConnectionStats) -> u64| stats.iter().map(f).sum::<u64>();
        let quic = [
            ("felix_quic_datagrams_sent", "UDP datagrams sent on open connections.", sum(|s| s.udp_tx.datagrams)),
            (
                "felix_quic_datagrams_received",
                "UDP datagrams received on open connections.",
                sum(|s| s.udp_rx.datagrams),
            ),
            (
                "felix_quic_send_calls",
                "Send system calls (a GSO batch is one) on open connections.",
                sum(|s| s.udp_tx.ios),
            ),
            ("felix_quic_receive_calls", "Receive system calls on open connections.", sum(|s| s.udp_rx.ios)),
            ("felix_quic_acks_sent", "ACK frames sent on open connections.", sum(|s| s.frame_tx.acks)),
            ("felix_quic_acks_received", "ACK frames received on open connections.", sum(|s| s.frame_rx.acks)),
            ("felix_quic_lost_packets", "Packets declared lost on open connections.", sum(|s| s.path.lost_packets)),
            (
                "felix_quic_black_holes",
                "MTU black holes detected on open connections.",
                sum(|s| s.path.black_holes_detected),
            ),
        ];
        for (name, help, v) in quic {
            m(name, "gauge", help, v);
        }
        let mtus = || stats.iter().map(|s| u64::from(s.path.current_mtu));
        m(
            "felix_quic_mtu_min",
            "gauge",
            "Smallest current path MTU among open connections.",
            mtus().min().unwrap_or(0),
        );
        m("felix_quic_mtu_max", "gauge", "Largest current path MTU among open connections.", mtus().max().unwrap_or(0));
        let writers: usize = self.conns.values().map(|c| c.writers.len()).sum();
        let gates: usize = self.conns.values().map(|c| c.gates.len()).sum();
        m("felix_driver_stream_writers", "gauge", "Stream writer tasks.", writers as u64);
        m("felix_driver_stream_readers", "gauge", "Stream reader tasks.", gates as u64);
        if let Node::Cluster(n) = &self.node {
            let r = n.rejoin_counts();
            m(
                "felix_replica_logs_damaged_total",
                "counter",
                "Replica logs found damaged (at start, or shorter than they had acknowledged): each replica rejoins its group afresh.",
                r.damaged,
            );
            m("felix_replica_rejoins_healed_total", "counter", "Of those, the replicas that rejoined.", r.healed);
            m(
                "felix_replicas_rejoining",
                "gauge",
                "Replicas here rejoining their group (granting no vote until it took them out and back in).",
                n.rejoining_replicas().len() as u64,
            );
            m(
                "felix_replicas_lingering",
                "gauge",
                "Replicas here the metadata no longer names, kept while their group may still count them as voters.",
                n.lingering_replicas() as u64,
            );
            m(
                "felix_replicas_readded_total",
                "counter",
                "Other brokers' rejoining replicas this broker, leading their group, took out and added back.",
                r.readded,
            );
            m(
                "felix_replica_groups",
                "gauge",
                "Replicated shards' Raft groups this broker holds a replica of.",
                n.replica_status().len() as u64,
            );
            m(
                "felix_replica_groups_sleeping",
                "gauge",
                "Of those, groups that sleep: settled, they do not tick until something wakes them (hibernation).",
                n.sleeping_replicas() as u64,
            );
            m(
                "felix_replica_leader_handovers_total",
                "counter",
                "Leaderships of settled groups this broker handed to their preferred replica (the first placement names), so leaders spread as placed.",
                n.preferred_handovers(),
            );
            m(
                "felix_replica_balance_moves_total",
                "counter",
                "Replica moves this broker proposed, as the metadata leader, to spread replicated shards' replicas over the active brokers (a broker added takes a fair share).",
                n.balance_moves(),
            );
            let (charged, waits, _, held, drops) = n.move_bandwidth_counts();
            m(
                "felix_move_bytes_total",
                "counter",
                "Bytes moves copied to and from this broker: durable shards' copies received, replicated shards' entries and snapshots sent to a move's target (--move-bandwidth paces them).",
                charged,
            );
            m("felix_move_bandwidth_waits_total", "counter", "Times a move's copy waited for --move-bandwidth.", waits);
            m(
                "felix_move_held_bytes",
                "gauge",
                "Bytes of replicated shards' entries and snapshots for moves' targets held back by --move-bandwidth now.",
                held,
            );
            m(
                "felix_move_dropped_appends_total",
                "counter",
                "Appends to moves' targets dropped (their leader sends them again) with the most --move-bandwidth holds back already held.",
                drops,
            );
            let snaps = n.meta_snapshot_counts();
            m(
                "felix_metadata_log_entries",
                "gauge",
                "Entries of the metadata Raft log this broker holds since its last metadata snapshot (in memory and in raft.log).",
                n.meta_log_entries(),
            );
            m(
                "felix_metadata_snapshots_total",
                "counter",
                "Metadata snapshots this broker took, compacting the metadata log (--metadata-snapshot-entries).",
                snaps.taken,
            );
            m(
                "felix_metadata_snapshots_received_total",
                "counter",
                "Metadata snapshots the metadata leader sent this broker (behind its compacted log) and it restored its metadata from.",
                snaps.received,
            );
            m(
                "felix_metadata_snapshot_bytes",
                "gauge",
                "The size of the last metadata snapshot this broker took.",
                snaps.bytes,
            );
            m(
                "felix_metadata_leads_applied_total",
                "counter",
                "Leadership claims of replicated shards the metadata applied here: each names a shard's new owner (redirects, topology).",
                n.leads_applied(),
            );
            m(
                "felix_replicas_replaying",
                "gauge",
                "Replicas replaying, after a restart, the committed entries their logs hold on disk (they take part in their groups once done).",
                n.replaying_replicas() as u64,
            );
            let (bytes, on_disk) = n.replica_entry_memory();
            m(
                "felix_replica_entry_bytes",
                "gauge",
                "Bytes of replicas' Raft log entries held in memory (each replica keeps its newest, --replica-entry-cache).",
                bytes,
            );
            m(
                "felix_replica_entries_on_disk",
                "gauge",
                "Entries of replicas' Raft logs held only in their log files (read back when a follower or a reader needs them).",
                on_disk,
            );
            m(
                "felix_replica_log_reads_total",
                "counter",
                "Reads of replica log files: entries for a follower behind, history below what memory holds.",
                self.replica_log_reads,
            );
            m(
                "felix_replica_snapshot_reads_total",
                "counter",
                "Reads of pieces of replicas' last snapshots, kept in their log files only, for a follower behind the compaction.",
                self.replica_snapshot_reads,
            );
            m(
                "felix_peer_queued_bytes",
                "gauge",
                "Bytes of messages queued for other brokers and not yet written to their streams (about).",
                self.transport.as_ref().map_or(0, |t| t.queued_bytes()),
            );
            m(
                "felix_replica_catch_up_reads_held_total",
                "counter",
                "Reads of entries for followers behind that a leader held until the links to other brokers drained (felix_peer_queued_bytes under 8 MiB).",
                n.catch_up_reads_held().0,
            );
            let restores = n.restore_counts();
            m(
                "felix_replica_restores_in_pieces_total",
                "counter",
                "Snapshots whose state a replica read back from disk a piece at a time (installed, or kept across a restart; states of 1 MiB or more), finished.",
                restores.finished,
            );
            m(
                "felix_replica_restore_read_failures_total",
                "counter",
                "Reads of a snapshot's state back from disk that failed (each is tried again at the next tick).",
                restores.failed_reads,
            );
            m(
                "felix_replica_restores_given_up_total",
                "counter",
                "Restores whose reads failed for 30 s: the replica dropped its log and rejoined its group afresh.",
                restores.given_up,
            );
            m(
                "felix_replica_restoring",
                "gauge",
                "Replicas whose snapshot's state is being read back from disk (they serve nothing of their shard meanwhile).",
                n.restoring() as u64,
            );
            m(
                "felix_replica_snapshot_bytes",
                "gauge",
                "Bytes of replicas' snapshot data held in memory (only what is being sent: snapshots stay in the log files).",
                n.replica_snapshot_memory(),
            );
            m(
                "felix_replica_checkpoint_bytes",
                "gauge",
                "Bytes of replicas' checkpoints held in memory waiting for retention (a stream's commit state in them is shared with the live state, not counted).",
                n.replica_checkpoint_memory(),
            );
        }
        m(
            "felix_runtime_alive_tasks",
            "gauge",
            "Tasks alive in the broker's runtime.",
            tokio::runtime::Handle::current().metrics().num_alive_tasks() as u64,
        );
        m("felix_streams_opened_total", "counter", "Client-opened QUIC streams.", self.io.streams_opened);
        m("felix_frames_in_total", "counter", "Frames received.", st.frames_in);
        m("felix_frames_in_json_total", "counter", "JSON frames received after auth.", st.frames_in_json);
        m("felix_frames_in_binary_publish_total", "counter", "Binary publish frames received.", st.frames_in_binary);
        m("felix_acks_sent_total", "counter", "Publish answers sent (binary acks and JSON).", st.acks_sent);
        m("felix_bytes_out_events_total", "counter", "Bytes written to event streams.", self.io.bytes_out_events);
        m("felix_bytes_in_total", "counter", "Bytes received on client streams.", self.io.bytes_in);
        m("felix_bytes_out_total", "counter", "Bytes written to client streams.", self.io.bytes_out);
        m("felix_publishes_json_total", "counter", "JSON publish requests.", st.publishes_json);
        m("felix_publishes_binary_total", "counter", "Binary publish frames.", st.publishes_binary);
        m(
            "felix_publishes_compressed_total",
            "counter",
            "Binary publish frames that arrived compressed.",
            st.publishes_compressed,
        );
        m(
            "felix_compressed_bytes_in_total",
            "counter",
            "Compressed bytes of compressed publish batches, as received.",
            st.compressed_bytes_in,
        );
        m(
            "felix_compressed_plain_bytes_in_total",
            "counter",
            "Plain bytes compressed publish batches inflated to.",
            st.compressed_plain_bytes_in,
        );
        m("felix_publishes_refused_total", "counter", "Publishes refused.", st.publishes_refused);
        m(
            "felix_unacked_publish_failures_total",
            "counter",
            "Failed fire-and-forget publishes (never answered).",
            st.unacked_failures,
        );
        m("felix_records_appended_total", "counter", "Records appended.", st.records_appended);
        m(
            "felix_event_batches_delivered_total",
            "counter",
            "Event batches written to subscribers.",
            st.batches_delivered,
        );
        m(
            "felix_subscriber_records_dropped_total",
            "counter",
            "Records dropped from full subscriber queues.",
            st.records_dropped,
        );
        m(
            "felix_publishers_held_total",
            "counter",
            "Times a publishing stream was held for a slow subscriber of a stream kept in memory.",
            st.publishers_held,
        );
        m(
            "felix_subscribers_excused_total",
            "counter",
            "Subscribers that held their publishers as long as allowed and were left behind.",
            st.subscribers_excused,
        );
        m("felix_subscriptions_lagged_total", "counter", "Subscriptions ended with subscription_lagged.", st.lagged);
        m("felix_cache_hits_total", "counter", "Cache reads that found a value.", st.cache_hits);
        m("felix_cache_misses_total", "counter", "Cache reads that found nothing.", st.cache_misses);
        m(
            "felix_protocol_violations_total",
            "counter",
            "Connections closed for a framing violation.",
            st.protocol_violations,
        );
        m(
            "felix_subscriber_queue_bytes",
            "gauge",
            "Bytes queued for subscribers.",
            self.node.broker_ref().queued_event_bytes() as u64,
        );
        m(
            "felix_retained_log_bytes",
            "gauge",
            "Memory the history held in memory costs: payload plus a fixed overhead per batch.",
            self.node.broker_ref().retained_log_bytes(),
        );
        m("felix_storage_writes_total", "counter", "Batches written to storage.", self.io.storage_writes);
        m("felix_storage_write_failures_total", "counter", "Storage writes that failed.", self.io.storage_failures);
        m(
            "felix_storage_full_total",
            "counter",
            "Storage writes that failed for lack of space (the shard then refuses publishes until a write succeeds).",
            self.io.storage_full,
        );
        m(
            "felix_storage_passes_total",
            "counter",
            "Group-commit passes of the storage thread.",
            self.io.storage_passes,
        );
        m(
            "felix_storage_pass_micros_total",
            "counter",
            "Time spent in storage passes (write and sync), microseconds.",
            self.io.storage_micros,
        );
        m("felix_storage_pass_micros_max", "gauge", "Longest storage pass, microseconds.", self.io.storage_micros_max);
        if let Some(t) = &self.transport {
            crate::peer_links::render(&t.links(), &mut out);
        }
        out
    }
}
