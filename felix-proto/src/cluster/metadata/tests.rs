use super::*;
use proptest::prelude::*;

fn join(id: &str) -> Command {
    Command::Join {
        member: Member {
            id: id.into(),
            client_addr: format!("{id}:5000"),
            cluster_addr: format!("{id}:7000"),
            state: MemberState::Active,
            incarnation: String::new(),
        },
    }
}

fn create(name: &str, shards: u32) -> Command {
    Command::Create {
        kind: Kind::Stream,
        tenant: "t".into(),
        namespace: "ns".into(),
        name: name.into(),
        shards,
        ephemeral: false,
        replication: 0,
    }
}

fn count(md: &Metadata, id: &str) -> usize {
    md.owners().values().filter(|a| a.owner == id).count()
}

/// Carries every move through cut-over to its end, as old and new owners would.
fn finish_moves(md: &mut Metadata) -> usize {
    let mut done = 0;
    while let Some((s, m)) = md.moves().iter().next().map(|(s, m)| (s.clone(), m.clone())) {
        md.apply(&Command::CutOver { shard: s.clone(), from: m.from.clone(), at: 7 }).unwrap();
        md.apply(&Command::FinishMove { shard: s, to: m.to, at: 7 }).unwrap();
        done += 1;
    }
    done
}

fn sid(name: &str, shard: u32) -> ShardId {
    ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: name.into(), shard }
}

/// Four members, stream `q` of one RF 3 shard led by its first replica: the metadata, the
/// shard, its replicas and the member outside its group.
fn four_brokers_and_a_led_rf3_shard() -> (Metadata, ShardId, Vec<String>, &'static str) {
    let mut md = Metadata::default();
    for c in [join("n1"), join("n2"), join("n3"), join("n4")] {
        md.apply(&c).unwrap();
    }
    md.apply(&Command::Create {
        kind: Kind::Stream,
        tenant: "t".into(),
        namespace: "ns".into(),
        name: "q".into(),
        shards: 1,
        ephemeral: false,
        replication: 3,
    })
    .unwrap();
    let q = sid("q", 0);
    let replicas = md.replicas(&q).unwrap().to_vec();
    md.apply(&Command::Lead { shard: q.clone(), node: replicas[0].clone(), term: 2 }).unwrap();
    let outsider = ["n1", "n2", "n3", "n4"].into_iter().find(|n| !replicas.iter().any(|r| r == n)).unwrap();
    (md, q, replicas, outsider)
}

#[test]
fn a_replicated_shard_moves_its_leadership_to_a_replica_or_a_replica_to_another_broker() {
    let (mut md, q, replicas, outsider) = four_brokers_and_a_led_rf3_shard();
    // To a broker outside the group: it takes the leader's place once the group says so
    // (its leader's finish); it may lead before that.
    md.apply(&Command::MoveShard { shard: q.clone(), to: outsider.into() }).unwrap();
    md.apply(&Command::Lead { shard: q.clone(), node: outsider.into(), term: 2 }).unwrap_err();
    md.apply(&Command::Lead { shard: q.clone(), node: outsider.into(), term: 3 }).unwrap();
    assert!(md.moving(&q).is_some(), "a replica move ends with its finish, not the lead");
    let stale = Command::FinishMove { shard: q.clone(), to: replicas[1].clone(), at: 0 };
    assert!(md.apply(&stale).is_err());
    md.apply(&Command::FinishMove { shard: q.clone(), to: outsider.into(), at: 0 }).unwrap();
    let mut group = replicas.clone();
    group[0] = outsider.to_owned();
    assert_eq!(md.replicas(&q).unwrap(), &group[..], "in the leaving replica's place");
    assert!(md.moving(&q).is_none());
    // And back (the first replica is outside the group now), for the rest of the test.
    md.apply(&Command::MoveShard { shard: q.clone(), to: replicas[0].clone() }).unwrap();
    md.apply(&Command::FinishMove { shard: q.clone(), to: replicas[0].clone(), at: 0 }).unwrap();
    md.apply(&Command::Lead { shard: q.clone(), node: replicas[0].clone(), term: 4 }).unwrap();
    assert_eq!(md.replicas(&q).unwrap(), &replicas[..]);
    // To another replica: a move until that one claims the lead.
    md.apply(&Command::MoveShard { shard: q.clone(), to: replicas[1].clone() }).unwrap();
    assert_eq!(
        md.moving(&q).map(|m| (m.from.as_str(), m.to.as_str())),
        Some((replicas[0].as_str(), replicas[1].as_str()))
    );
    let before = md.owner(&q).unwrap().clone();
    md.apply(&Command::Lead { shard: q.clone(), node: replicas[1].clone(), term: 6 }).unwrap();
    assert!(md.moving(&q).is_none());
    assert_eq!(md.owner(&q).unwrap().owner, replicas[1]);
    assert!(md.owner(&q).unwrap().generation > before.generation);
    // A cancelled one leaves the leader leading, at its generation.
    md.apply(&Command::MoveShard { shard: q.clone(), to: replicas[2].clone() }).unwrap();
    let before = md.owner(&q).unwrap().clone();
    md.apply(&Command::CancelMove { shard: q.clone() }).unwrap();
    assert_eq!(md.owner(&q), Some(&before));
    assert!(md.moving(&q).is_none());
    // A draining replica is replaced by the active broker outside the group.
    md.apply(&Command::Drain { id: replicas[1].clone() }).unwrap();
    let m = md.moving(&q).expect("a move off the draining broker").clone();
    assert_eq!((m.from.as_str(), m.to.as_str()), (replicas[1].as_str(), outsider));
}

#[test]
fn a_followers_replica_moves_to_a_broker_outside_the_group_into_its_place() {
    let (mut md, q, replicas, outsider) = four_brokers_and_a_led_rf3_shard();
    md.apply(&create("d", 1)).unwrap();
    let mv = |from: &str, to: &str| Command::MoveReplica { shard: q.clone(), from: from.into(), to: to.into() };
    // Refused: a broker holding no replica, a target holding one, a target not a member, a
    // shard that is not replicated.
    let before = md.clone();
    assert!(md.apply(&mv(outsider, outsider)).is_err());
    assert!(md.apply(&mv(&replicas[1], &replicas[2])).is_err());
    assert!(md.apply(&mv(&replicas[1], "n9")).is_err());
    let plain = Command::MoveReplica { shard: sid("d", 0), from: "n1".into(), to: "n2".into() };
    assert!(md.apply(&plain).unwrap_err().to_string().contains("not replicated"));
    assert_eq!(md, before, "nothing changed");
    // A follower's replica: the leader leads on, the target takes the follower's place.
    md.apply(&mv(&replicas[1], outsider)).unwrap();
    assert!(md.apply(&mv(&replicas[2], outsider)).unwrap_err().to_string().contains("already moving"));
    let m = md.moving(&q).unwrap().clone();
    assert_eq!((m.from.as_str(), m.to.as_str(), m.phase), (replicas[1].as_str(), outsider, MovePhase::CatchingUp));
    assert_eq!(md.owner(&q).unwrap().owner, replicas[0]);
    md.apply(&Command::FinishMove { shard: q.clone(), to: outsider.into(), at: 0 }).unwrap();
    let mut group = replicas.clone();
    group[1] = outsider.to_owned();
    assert_eq!(md.replicas(&q).unwrap(), &group[..]);
    assert_eq!(md.owner(&q).unwrap().owner, replicas[0], "still its leader");
    assert!(md.moving(&q).is_none());
    // It reads back as it was written.
    let c = mv(&replicas[2], &replicas[1]);
    assert_eq!(Command::decode(&c.encode()).unwrap(), c);
}

#[test]
fn a_durable_shard_moves_through_its_lifecycle_and_an_in_memory_one_at_once() {
    let mut md = Metadata::default();
    for c in [join("n1"), join("n2"), create("d", 2)] {
        md.apply(&c).unwrap();
    }
    md.apply(&Command::Create {
        kind: Kind::Stream,
        tenant: "t".into(),
        namespace: "ns".into(),
        name: "m".into(),
        shards: 2,
        ephemeral: true,
        replication: 0,
    })
    .unwrap();
    let d = (0..2).map(|i| sid("d", i)).find(|s| md.owner(s).unwrap().owner == "n1").unwrap();
    let before = md.owner(&d).unwrap().clone();
    let mv = Command::MoveShard { shard: d.clone(), to: "n2".into() };
    assert_eq!(Command::decode(&mv.encode()).unwrap(), mv);
    md.apply(&mv).unwrap();
    assert_eq!(md.owner(&d), Some(&before), "it stays on n1 while it is copied");
    assert_eq!(
        md.moving(&d).map(|m| (m.from.as_str(), m.to.as_str(), m.phase)),
        Some(("n1", "n2", MovePhase::CatchingUp))
    );
    // Refused: moving it again, a stale cut-over, a finish before the cut-over or with
    // another tail.
    assert!(matches!(md.apply(&mv), Err(CommandError::Move(_))));
    assert!(md.apply(&Command::CutOver { shard: d.clone(), from: "n2".into(), at: 5 }).is_err());
    assert!(md.apply(&Command::FinishMove { shard: d.clone(), to: "n2".into(), at: 5 }).is_err());
    md.apply(&Command::CutOver { shard: d.clone(), from: "n1".into(), at: 5 }).unwrap();
    assert_eq!(md.moving(&d).unwrap().phase, MovePhase::CutOver { at: 5 });
    assert!(md.apply(&Command::FinishMove { shard: d.clone(), to: "n2".into(), at: 4 }).is_err());
    md.apply(&Command::FinishMove { shard: d.clone(), to: "n2".into(), at: 5 }).unwrap();
    assert_eq!(md.owner(&d), Some(&Assignment { owner: "n2".into(), generation: before.generation + 1 }));
    assert!(md.moves().is_empty());
    // Where the operator put it, it stays: a third broker joining does not take it.
    md.apply(&join("n3")).unwrap();
    finish_moves(&mut md);
    assert_eq!(md.owner(&d).unwrap().owner, "n2");
    // An in-memory shard has nothing to copy: it changes owner at once.
    let m = sid("m", 0);
    let was = md.owner(&m).unwrap().clone();
    let to = ["n1", "n2", "n3"].into_iter().find(|n| *n != was.owner).unwrap();
    md.apply(&Command::MoveShard { shard: m.clone(), to: to.into() }).unwrap();
    assert_eq!(md.owner(&m), Some(&Assignment { owner: to.into(), generation: was.generation + 1 }));
    assert!(md.moving(&m).is_none());
    // Refused: to a broker that is not an active member, to where it is, an unknown shard.
    for bad in [
        Command::MoveShard { shard: d.clone(), to: "n9".into() },
        Command::MoveShard { shard: d.clone(), to: "n2".into() },
    ] {
        assert!(matches!(md.apply(&bad), Err(CommandError::Move(_))), "{bad:?}");
    }
    assert!(matches!(
        md.apply(&Command::MoveShard { shard: sid("nope", 0), to: "n1".into() }),
        Err(CommandError::Unknown(_))
    ));
}

#[test]
fn a_join_starts_a_few_moves_at_a_time_and_a_cancelled_or_orphaned_move_leaves_the_shard_home() {
    let mut md = Metadata::default();
    for c in [join("n1"), create("d", 12)] {
        md.apply(&c).unwrap();
    }
    for i in 0..4 {
        md.apply(&Command::Create {
            kind: Kind::Cache,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: format!("c{i}"),
            shards: 1,
            ephemeral: false,
            replication: 0,
        })
        .unwrap();
    }
    assert_eq!(count(&md, "n1"), 16);
    md.apply(&join("n2")).unwrap();
    // Placement wants eight shards on n2 (streams' and caches': a cache is copied too);
    // four start, the rest wait for them.
    assert_eq!(md.moves().len(), MAX_PLACEMENT_MOVES);
    assert_eq!(count(&md, "n1"), 16, "nothing changed owner yet");
    assert!(md.moves().values().all(|m| m.from == "n1" && m.to == "n2"));
    let (s, m) = md.moves().iter().next().map(|(s, m)| (s.clone(), m.clone())).unwrap();
    md.apply(&Command::CutOver { shard: s.clone(), from: m.from, at: 1 }).unwrap();
    md.apply(&Command::FinishMove { shard: s, to: m.to, at: 1 }).unwrap();
    assert!(!md.moves().is_empty() && md.moves().len() <= MAX_PLACEMENT_MOVES, "the next ones started");
    finish_moves(&mut md);
    assert_eq!([count(&md, "n1"), count(&md, "n2")], [8, 8]);
    // A cancelled move: the shard stays home at the next generation and is not moved
    // again by itself.
    md.apply(&join("n3")).unwrap();
    let (s, _) = md.moves().iter().next().map(|(s, m)| (s.clone(), m.clone())).unwrap();
    let before = md.owner(&s).unwrap().clone();
    md.apply(&Command::CancelMove { shard: s.clone() }).unwrap();
    assert_eq!(md.owner(&s), Some(&Assignment { owner: before.owner.clone(), generation: before.generation + 1 }));
    assert!(md.moving(&s).is_none());
    assert_eq!(md.pins().get(&s), Some(&before.owner));
    // The new owner going down gives up its moves the same way.
    let going: Vec<ShardId> = md.moves().iter().filter(|(_, m)| m.to == "n3").map(|(s, _)| s.clone()).collect();
    assert!(!going.is_empty());
    md.apply(&Command::MarkDown { id: "n3".into() }).unwrap();
    for s in &going {
        assert!(md.moving(s).is_none(), "{s:?}");
        assert_ne!(md.owner(s).unwrap().owner, "n3");
    }
    assert!(matches!(md.apply(&Command::CancelMove { shard: s }), Err(CommandError::Move(_))));
}

#[test]
fn revocations_accumulate_round_trip_and_move_no_shard() {
    let mut md = Metadata::default();
    md.apply(&join("a")).unwrap();
    md.apply(&create("s", 4)).unwrap();
    let owners = md.owners().clone();
    let r = Command::Revoke { jti: Some("leaked".into()), sub: None };
    assert_eq!(Command::decode(&r.encode()).unwrap(), r);
    assert_eq!(String::from_utf8(r.encode()).unwrap(), r#"{"op":"revoke","jti":"leaked"}"#);
    md.apply(&r).unwrap();
    md.apply(&Command::Revoke { jti: None, sub: Some("mallory".into()) }).unwrap();
    md.apply(&r).unwrap();
    assert_eq!(md.revoked_jti().iter().collect::<Vec<_>>(), ["leaked"]);
    assert_eq!(md.revoked_sub().iter().collect::<Vec<_>>(), ["mallory"]);
    assert_eq!(md.apply(&Command::Revoke { jti: None, sub: None }), Err(CommandError::EmptyRevocation));
    assert_eq!(md.owners(), &owners, "no shard moved, no generation changed");
}

#[test]
fn a_member_marked_down_keeps_its_durable_shards_and_hands_over_its_in_memory_ones() {
    let mut md = Metadata::default();
    for c in [join("n1"), join("n2"), join("n3"), create("durable", 6)] {
        md.apply(&c).unwrap();
    }
    md.apply(&Command::Create {
        kind: Kind::Stream,
        tenant: "t".into(),
        namespace: "ns".into(),
        name: "memory".into(),
        shards: 6,
        ephemeral: true,
        replication: 0,
    })
    .unwrap();
    let before = md.owners().clone();
    md.apply(&Command::MarkDown { id: "n3".into() }).unwrap();
    for (s, a) in md.owners() {
        let was = &before[s];
        if was.owner != "n3" {
            assert_eq!(a, was, "{s:?}: nothing else moves");
        } else if s.name == "durable" {
            assert_eq!(a, was, "{s:?}: a durable shard waits for its owner");
            assert!(md.unavailable(s));
        } else {
            assert_ne!(a.owner, "n3", "{s:?}: an in-memory shard moves");
            assert!(a.generation > was.generation);
            assert!(!md.unavailable(s));
        }
    }
    // Back: it serves its durable shards again, same generation (nobody else had them).
    md.apply(&join("n3")).unwrap();
    for (s, a) in md.owners() {
        if s.name == "durable" && before[s].owner == "n3" {
            assert_eq!(a, &before[s]);
            assert!(!md.unavailable(s));
        }
    }
    // An operator's remove forces them over (what only n3 held is lost; documented).
    md.apply(&Command::MarkDown { id: "n3".into() }).unwrap();
    md.apply(&Command::Remove { id: "n3".into() }).unwrap();
    assert!(md.owners().values().all(|a| a.owner != "n3"));
    assert!(md.owners().keys().all(|s| !md.unavailable(s)));
}

#[test]
fn members_share_shards_and_a_drained_member_owns_none() {
    let mut md = Metadata::default();
    for c in [join("n1"), join("n2"), join("n3"), create("orders", 6), create("events", 3)] {
        md.apply(&c).unwrap();
    }
    assert_eq!(md.owners().len(), 9);
    assert_eq!([count(&md, "n1"), count(&md, "n2"), count(&md, "n3")], [3, 3, 3]);
    let before = md.clone();
    md.apply(&Command::Drain { id: "n2".into() }).unwrap();
    // Its durable shards move (copied first), a few at a time: each is done once its new
    // owner says so.
    assert_eq!(count(&md, "n2"), 3);
    assert_eq!(md.moves().len(), 3);
    finish_moves(&mut md);
    assert_eq!(count(&md, "n2"), 0);
    for (s, a) in md.owners() {
        let old = &before.owners()[s];
        if a.owner == old.owner {
            assert_eq!(a.generation, old.generation, "an unmoved shard keeps its generation");
        } else {
            assert_eq!(old.owner, "n2", "only the drained member's shards move");
            assert_eq!(a.generation, old.generation + 1);
        }
    }
    assert_eq!(md.apply(&create("orders", 2)), Err(CommandError::Exists { name: "orders".into(), shards: 6 }));
    assert!(matches!(md.apply(&create("zero", 0)), Err(CommandError::BadShardCount { .. })));
    assert_eq!(md.apply(&Command::Remove { id: "n9".into() }), Err(CommandError::UnknownMember("n9".into())));
    md.apply(&Command::Delete {
        kind: Kind::Stream,
        tenant: "t".into(),
        namespace: "ns".into(),
        name: "events".into(),
    })
    .unwrap();
    assert_eq!(md.owners().len(), 6);
    assert_eq!(md.shard_count(Kind::Stream, "t", "ns", "events"), None);
}

#[test]
fn with_no_active_member_shards_keep_their_last_owner() {
    let mut md = Metadata::default();
    for c in [join("n1"), create("s", 2), Command::Remove { id: "n1".into() }] {
        md.apply(&c).unwrap();
    }
    assert!(md.owners().values().all(|a| a.owner == "n1" && a.generation == 1));
    md.apply(&join("n2")).unwrap();
    assert!(md.owners().values().all(|a| a.owner == "n2" && a.generation == 2));
}

#[test]
fn commands_round_trip_and_garbage_is_refused() {
    for c in [join("n1"), create("s", 3), Command::Drain { id: "n1".into() }] {
        assert_eq!(Command::decode(&c.encode()), Ok(c));
    }
    assert!(matches!(Command::decode(b"{\"op\":\"explode\"}"), Err(CommandError::Decode(_))));
    assert!(matches!(Command::decode(b"\xFF"), Err(CommandError::Decode(_))));
}

/// The metadata group end to end: the leader proposes, every member applies what the group
/// committed, and all three hold the same metadata.
#[test]
fn a_raft_group_keeps_every_members_metadata_equal() {
    use crate::cluster::meta::{MetaNode, MetaOutput};
    let ids = [1u64, 2, 3];
    let mut nodes: Vec<MetaNode> = ids.iter().map(|&id| MetaNode::new(id, &ids).unwrap()).collect();
    let mut md = vec![Metadata::default(); 3];
    let step = |nodes: &mut Vec<MetaNode>, md: &mut Vec<Metadata>, ticks: usize| {
        for _ in 0..ticks {
            nodes.iter_mut().for_each(MetaNode::tick);
            loop {
                let mut msgs = Vec::new();
                for (i, n) in nodes.iter_mut().enumerate() {
                    while let Some(o) = n.poll_output() {
                        match o {
                            MetaOutput::Send { to, message } => msgs.push((to, message)),
                            MetaOutput::Committed { data, .. } => {
                                let _ = md[i].apply(&Command::decode(&data).unwrap());
                            }
                            MetaOutput::Persist { .. }
                            | MetaOutput::PersistSnapshot { .. }
                            | MetaOutput::ReadIndex { .. }
                            | MetaOutput::ReadEntries { .. }
                            | MetaOutput::ReadSnapshot { .. }
                            | MetaOutput::ConfChanged { .. } => {}
                        }
                    }
                }
                if msgs.is_empty() {
                    break;
                }
                for (to, m) in msgs {
                    let _ = nodes[(to - 1) as usize].step(m);
                }
            }
        }
    };
    step(&mut nodes, &mut md, 30);
    let leader = nodes.iter().position(MetaNode::is_leader).unwrap();
    for c in [join("n1"), join("n2"), join("n3"), create("orders", 7), Command::Drain { id: "n3".into() }] {
        nodes[leader].propose(c.encode()).unwrap();
    }
    step(&mut nodes, &mut md, 5);
    assert_eq!(md[0].owners().len(), 7);
    // The drained member's durable shards are on their way off it.
    assert_eq!(md[0].moves().values().filter(|m| m.from == "n3").count(), count(&md[0], "n3"));
    assert_eq!(md[0], md[1]);
    assert_eq!(md[1], md[2]);
}

fn command() -> impl Strategy<Value = Command> {
    let id = (1u8..6).prop_map(|i| format!("n{i}"));
    prop_oneof![
        id.clone().prop_map(|i| join(&i)),
        id.clone().prop_map(|id| Command::Drain { id }),
        id.prop_map(|id| Command::Remove { id }),
        ((0u8..4), (0u32..9)).prop_map(|(n, s)| create(&format!("s{n}"), s)),
        (0u8..4).prop_map(|n| Command::Delete {
            kind: Kind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: format!("s{n}")
        }),
    ]
}

fn command_or_replicated() -> impl Strategy<Value = Command> {
    prop_oneof![
        3 => command(),
        // An operator's move (the shard is then pinned to its broker) and a member declared
        // down: placement leaves both kinds of shard alone.
        1 => ((0u8..4), (0u32..4), (1u8..6)).prop_map(|(n, shard, to)| Command::MoveShard {
            shard: ShardId {
                kind: Kind::Stream,
                tenant: "t".into(),
                namespace: "ns".into(),
                name: format!("s{n}"),
                shard,
            },
            to: format!("n{to}"),
        }),
        1 => (1u8..6).prop_map(|i| Command::MarkDown { id: format!("n{i}") }),
        1 => ((0u8..4), (1u32..5), (2u32..4)).prop_map(|(n, shards, replication)| Command::Create {
            kind: Kind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: format!("r{n}"),
            shards,
            ephemeral: false,
            replication,
        }),
    ]
}

proptest! {
    /// Creating a stream places its shards (a replicated one's replicas) and skips the
    /// rebalance of every other shard: over any sequence of commands (replicated streams,
    /// operator moves and members declared down among them) the
    /// metadata is the same, command by command, as with the whole rebalance after each
    /// (what an older broker of the same cluster computes).
    #[test]
    fn the_create_shortcuts_change_nothing_the_whole_rebalance_would(
        cmds in proptest::collection::vec(command_or_replicated(), 1..40)
    ) {
        let mut short = Metadata::default();
        let mut whole = Metadata::default();
        for c in &cmds {
            prop_assert_eq!(short.apply(c), whole.apply_inner(c, true));
            prop_assert_eq!(&short, &whole);
            // Every move carried to its end, as brokers would (a replicated shard's with
            // its finish), through the same path on both.
            for _ in 0..64 {
                let Some((s, m)) = short.moves().iter().next().map(|(s, m)| (s.clone(), m.clone())) else { break };
                let steps = if short.replicas(&s).is_some() {
                    vec![Command::FinishMove { shard: s, to: m.to, at: 0 }]
                } else {
                    vec![
                        Command::CutOver { shard: s.clone(), from: m.from.clone(), at: 7 },
                        Command::FinishMove { shard: s, to: m.to, at: 7 },
                    ]
                };
                for step in steps {
                    prop_assert_eq!(short.apply(&step), whole.apply_inner(&step, true));
                    prop_assert_eq!(&short, &whole);
                }
            }
        }
    }

    /// Over any sequence of commands, each followed by the moves it started running to
    /// their end (as brokers carry them out): generations only grow (per shard, while it
    /// exists) and grow with every change of owner, owners are active members whenever one
    /// exists, loads differ by at most one, and two members applying the same commands hold
    /// the same metadata.
    #[test]
    fn invariants_hold_over_any_command_sequence(cmds in proptest::collection::vec(command(), 1..40)) {
        let mut a = Metadata::default();
        let mut b = Metadata::default();
        for c in &cmds {
            let before = a.owners().clone();
            let ra = a.apply(c);
            prop_assert_eq!(&ra, &b.apply(&Command::decode(&c.encode()).unwrap()));
            finish_moves(&mut a);
            finish_moves(&mut b);
            for (s, asg) in a.owners() {
                if let Some(old) = before.get(s) {
                    prop_assert!(asg.generation >= old.generation);
                    prop_assert!(asg.owner == old.owner || asg.generation > old.generation);
                }
            }
            let active: Vec<&String> =
                a.members().values().filter(|m| m.state == MemberState::Active).map(|m| &m.id).collect();
            if !active.is_empty() {
                prop_assert!(a.owners().values().all(|x| active.contains(&&x.owner)));
                let loads: Vec<usize> = active.iter().map(|id| count(&a, id)).collect();
                prop_assert!(loads.iter().max().unwrap() - loads.iter().min().unwrap() <= 1);
            }
        }
        prop_assert_eq!(a, b);
    }
}
