//! What the service tells clients of the commands it serves, as Redis 7.0 tells of its
//! own in `COMMAND` and `COMMAND INFO`: each command's arity, flags, where its keys are,
//! ACL categories and tips, and its subcommands. Clients that route requests by key read
//! the keys' places from it (redis-py's cluster client does), and a node of a cluster
//! checks a request's keys where the same table puts them.

use crate::kvcache::resp::{reply, Proto};

/// Where a command's keys are, as a Redis 7 key specification gives them: from argument
/// `begin` (the command's name is 0) to `last` arguments after it (negative: counted
/// from the end, -1 the last argument), every `step`th; `access`, what it does to them
/// (words).
#[derive(Debug, Clone, Copy)]
pub(super) struct Keys {
    pub begin: i64,
    pub last: i64,
    pub step: i64,
    pub access: &'static str,
}

/// A command's one key, the argument after its name.
const fn key(access: &'static str) -> Option<Keys> {
    keys(0, 1, access)
}

/// A command's keys from the argument after its name to `last` after it, every `step`th.
const fn keys(last: i64, step: i64, access: &'static str) -> Option<Keys> {
    Some(Keys {
        begin: 1,
        last,
        step,
        access,
    })
}

impl Keys {
    /// The places of the keys in a request of `words` (its name first), or `None` when it
    /// has fewer words than the keys need.
    pub fn of(&self, words: usize) -> Option<impl Iterator<Item = usize>> {
        let begin = usize::try_from(self.begin).ok()?;
        let last = if self.last >= 0 {
            begin + usize::try_from(self.last).ok()?
        } else {
            words.checked_sub(usize::try_from(-self.last).ok()?)?
        };
        let step = usize::try_from(self.step).ok()?.max(1);
        (begin <= last && last < words).then(|| (begin..=last).step_by(step))
    }

    /// `COMMAND INFO`'s first key, last key and step (Redis 6's form): the last counted
    /// from the name, or from the end when negative.
    fn classic(&self) -> [i64; 3] {
        let last = if self.last >= 0 {
            self.begin + self.last
        } else {
            self.last
        };
        [self.begin, last, self.step]
    }
}

/// Keys a command names after a keyword, past those its first key specification covers
/// (`MIGRATE … KEYS key …`): Redis 7 describes them by a second specification, marked
/// incomplete, that searches for `keyword` from argument `from` (negative: counted from
/// the end, searching back) and takes every argument after it; and finds a request's
/// keys by the command's own reading of its arguments (`places`), as it does here.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeywordKeys {
    pub keyword: &'static str,
    pub from: i64,
    pub access: &'static str,
    pub places: fn(&[&[u8]]) -> Vec<usize>,
}

/// What `COMMAND INFO` tells of a command or subcommand beside its name and arity; each
/// list is of words.
#[derive(Debug, Clone, Copy)]
pub(super) struct Traits {
    pub flags: &'static str,
    /// Its ACL categories.
    pub acl: &'static str,
    /// How a cluster client routes it and merges its replies, and what varies in them.
    pub tips: &'static str,
    pub keys: Option<Keys>,
    pub keyword_keys: Option<KeywordKeys>,
}

impl Traits {
    /// The places of the keys of a request of `words` (its name first); `None` when it
    /// has fewer words than its keys need.
    pub fn key_places(&self, words: &[&[u8]]) -> Option<Vec<usize>> {
        match self.keyword_keys {
            Some(k) => Some((k.places)(words)),
            None => Some(self.keys?.of(words.len())?.collect()),
        }
    }

    /// These traits with `tips`.
    const fn tips(self, tips: &'static str) -> Traits {
        Traits { tips, ..self }
    }
}

const fn traits(
    flags: &'static str,
    acl: &'static str,
    tips: &'static str,
    keys: Option<Keys>,
) -> Traits {
    Traits {
        flags,
        acl,
        tips,
        keys,
        keyword_keys: None,
    }
}

/// A command served.
#[derive(Debug, Clone, Copy)]
pub(super) struct Command {
    pub name: &'static str,
    /// How many words a request has, its name included: exactly that many, or at least
    /// as many as its negation.
    pub arity: i64,
    pub traits: Traits,
}

const fn command(
    name: &'static str,
    arity: i64,
    flags: &'static str,
    acl: &'static str,
    tips: &'static str,
    keys: Option<Keys>,
) -> Command {
    Command {
        name,
        arity,
        traits: traits(flags, acl, tips, keys),
    }
}

/// Every command served, sorted by name: flags, ACL categories and tips are lists of
/// words.
pub(super) const CATALOG: [Command; 58] = [
    command("asking", 1, "fast", "@fast @connection", "", None),
    command(
        "auth",
        -2,
        "noscript loading stale fast no_auth allow_busy",
        "@fast @connection",
        "",
        None,
    ),
    command("client", -2, "", "@slow", "", None),
    command("cluster", -2, "", "@slow", "", None),
    command(
        "command",
        -1,
        "loading stale",
        "@slow @connection",
        "nondeterministic_output_order",
        None,
    ),
    command("config", -2, "", "@slow", "", None),
    command(
        "dbsize",
        1,
        "readonly fast",
        "@keyspace @read @fast",
        "request_policy:all_shards response_policy:agg_sum",
        None,
    ),
    command(
        "del",
        -2,
        "write",
        "@keyspace @write @slow",
        "request_policy:multi_shard response_policy:agg_sum",
        keys(-1, 1, "RM delete"),
    ),
    command(
        "discard",
        1,
        "noscript loading stale fast allow_busy",
        "@fast @transaction",
        "",
        None,
    ),
    command(
        "dump",
        2,
        "readonly",
        "@keyspace @read @slow",
        "nondeterministic_output",
        key("RO access"),
    ),
    command(
        "echo",
        2,
        "loading stale fast",
        "@fast @connection",
        "",
        None,
    ),
    command(
        "exec",
        1,
        "noscript loading stale skip_slowlog",
        "@slow @transaction",
        "",
        None,
    ),
    command(
        "exists",
        -2,
        "readonly fast",
        "@keyspace @read @fast",
        "request_policy:multi_shard response_policy:agg_sum",
        keys(-1, 1, "RO"),
    ),
    command(
        "expire",
        -3,
        "write fast",
        "@keyspace @write @fast",
        "",
        key("RW update"),
    ),
    command(
        "expireat",
        -3,
        "write fast",
        "@keyspace @write @fast",
        "",
        key("RW update"),
    ),
    command(
        "expiretime",
        2,
        "readonly fast",
        "@keyspace @read @fast",
        "",
        key("RO access"),
    ),
    command(
        "flushall",
        -1,
        "write",
        "@keyspace @write @slow @dangerous",
        "request_policy:all_shards response_policy:all_succeeded",
        None,
    ),
    command(
        "flushdb",
        -1,
        "write",
        "@keyspace @write @slow @dangerous",
        "request_policy:all_shards response_policy:all_succeeded",
        None,
    ),
    command(
        "get",
        2,
        "readonly fast",
        "@read @string @fast",
        "",
        key("RO access"),
    ),
    command(
        "getdel",
        2,
        "write fast",
        "@write @string @fast",
        "",
        key("RW access delete"),
    ),
    command(
        "getex",
        -2,
        "write fast",
        "@write @string @fast",
        "",
        key("RW access update"),
    ),
    command(
        "getset",
        3,
        "write denyoom fast",
        "@write @string @fast",
        "",
        key("RW access update"),
    ),
    command(
        "hello",
        -1,
        "noscript loading stale fast no_auth allow_busy",
        "@fast @connection",
        "",
        None,
    ),
    command(
        "info",
        -1,
        "loading stale",
        "@slow @dangerous",
        "nondeterministic_output request_policy:all_shards response_policy:special",
        None,
    ),
    command(
        "keys",
        2,
        "readonly",
        "@keyspace @read @slow @dangerous",
        "request_policy:all_shards nondeterministic_output_order",
        None,
    ),
    command(
        "lastsave",
        1,
        "loading stale fast",
        "@admin @fast @dangerous",
        "nondeterministic_output",
        None,
    ),
    command("latency", -2, "", "@slow", "", None),
    command("memory", -2, "", "@slow", "", None),
    command(
        "mget",
        -2,
        "readonly fast",
        "@read @string @fast",
        "request_policy:multi_shard",
        keys(-1, 1, "RO access"),
    ),
    Command {
        name: "migrate",
        arity: -6,
        traits: Traits {
            keyword_keys: Some(KeywordKeys {
                keyword: "KEYS",
                from: -2,
                access: "RW access delete incomplete",
                places: super::migrate::key_places,
            }),
            ..traits(
                "write movablekeys",
                "@keyspace @write @slow @dangerous",
                "nondeterministic_output",
                Some(Keys {
                    begin: 3,
                    last: 0,
                    step: 1,
                    access: "RW access delete",
                }),
            )
        },
    },
    command(
        "monitor",
        1,
        "admin noscript loading stale",
        "@admin @slow @dangerous",
        "",
        None,
    ),
    command(
        "mset",
        -3,
        "write denyoom",
        "@write @string @slow",
        "request_policy:multi_shard response_policy:all_succeeded",
        keys(-1, 2, "OW update"),
    ),
    command(
        "multi",
        1,
        "noscript loading stale fast allow_busy",
        "@fast @transaction",
        "",
        None,
    ),
    command(
        "persist",
        2,
        "write fast",
        "@keyspace @write @fast",
        "",
        key("RW update"),
    ),
    command(
        "pexpire",
        -3,
        "write fast",
        "@keyspace @write @fast",
        "",
        key("RW update"),
    ),
    command(
        "pexpireat",
        -3,
        "write fast",
        "@keyspace @write @fast",
        "",
        key("RW update"),
    ),
    command(
        "pexpiretime",
        2,
        "readonly fast",
        "@keyspace @read @fast",
        "",
        key("RO access"),
    ),
    command(
        "ping",
        -1,
        "fast",
        "@fast @connection",
        "request_policy:all_shards response_policy:all_succeeded",
        None,
    ),
    command(
        "psetex",
        4,
        "write denyoom",
        "@write @string @slow",
        "",
        key("OW update"),
    ),
    command(
        "pttl",
        2,
        "readonly fast",
        "@keyspace @read @fast",
        "nondeterministic_output",
        key("RO access"),
    ),
    command(
        "quit",
        -1,
        "noscript loading stale fast no_auth allow_busy",
        "@fast @connection",
        "",
        None,
    ),
    command(
        "readonly",
        1,
        "loading stale fast",
        "@fast @connection",
        "",
        None,
    ),
    command(
        "readwrite",
        1,
        "loading stale fast",
        "@fast @connection",
        "",
        None,
    ),
    command(
        "restore",
        -4,
        "write denyoom",
        "@keyspace @write @slow @dangerous",
        "",
        key("OW update"),
    ),
    command(
        "restore-asking",
        -4,
        "write denyoom asking",
        "@keyspace @write @slow @dangerous",
        "",
        key("OW update"),
    ),
    command(
        "save",
        1,
        "admin noscript no_async_loading no_multi",
        "@admin @slow @dangerous",
        "",
        None,
    ),
    command(
        "scan",
        -2,
        "readonly",
        "@keyspace @read @slow",
        "nondeterministic_output request_policy:special",
        None,
    ),
    command(
        "select",
        2,
        "loading stale fast",
        "@fast @connection",
        "",
        None,
    ),
    command(
        "set",
        -3,
        "write denyoom",
        "@write @string @slow",
        "",
        key("RW access update variable_flags"),
    ),
    command(
        "setex",
        4,
        "write denyoom",
        "@write @string @slow",
        "",
        key("OW update"),
    ),
    command(
        "setnx",
        3,
        "write denyoom fast",
        "@write @string @fast",
        "",
        key("OW insert"),
    ),
    command("slowlog", -2, "", "@slow", "", None),
    command(
        "strlen",
        2,
        "readonly fast",
        "@read @string @fast",
        "",
        key("RO"),
    ),
    command(
        "ttl",
        2,
        "readonly fast",
        "@keyspace @read @fast",
        "nondeterministic_output",
        key("RO access"),
    ),
    command(
        "type",
        2,
        "readonly fast",
        "@keyspace @read @fast",
        "",
        key("RO"),
    ),
    command(
        "unlink",
        -2,
        "write fast",
        "@keyspace @write @fast",
        "request_policy:multi_shard response_policy:agg_sum",
        keys(-1, 1, "RM delete"),
    ),
    command(
        "unwatch",
        1,
        "noscript loading stale fast allow_busy",
        "@fast @transaction",
        "",
        None,
    ),
    command(
        "watch",
        -2,
        "noscript loading stale fast allow_busy",
        "@fast @transaction",
        "",
        keys(-1, 1, "RO"),
    ),
];

/// What the subcommands of a kind share.
const CONNECTION: Traits = traits("noscript loading stale", "@slow @connection", "", None);
const CLIENT_ADMIN: Traits = traits(
    "admin noscript loading stale",
    "@admin @slow @dangerous @connection",
    "",
    None,
);
const CLUSTER: Traits = traits("stale", "@slow", "", None);
const COMMAND_SUB: Traits = traits("loading stale", "@slow @connection", "", None);
const ADMIN: Traits = traits(
    "admin noscript loading stale",
    "@admin @slow @dangerous",
    "",
    None,
);
const SLOWLOG: Traits = traits("admin loading stale", "@admin @slow @dangerous", "", None);
/// `MEMORY USAGE key`'s key.
const MEMORY_USAGE_KEY: Option<Keys> = Some(Keys {
    begin: 2,
    last: 0,
    step: 1,
    access: "RO",
});

/// A subcommand served: its name as Redis names it (and `CLIENT LIST` shows it), the
/// fewest and most arguments it takes after its name, and its `HELP`.
pub(super) struct Subcommand {
    pub name: &'static str,
    pub least: usize,
    pub most: usize,
    pub usage: &'static str,
    /// Its description, lines split at `|`.
    pub what: &'static str,
    pub traits: Traits,
}

impl Subcommand {
    /// Its arity as `COMMAND INFO` gives it: its words counted with the command's.
    pub fn arity(&self) -> i64 {
        let least = self.least as i64 + 2;
        if self.least == self.most {
            least
        } else {
            -least
        }
    }
}

/// The subcommands served, by command.
pub(super) const SUBCOMMANDS: [Subcommand; 31] = [
    Subcommand {
        name: "client|getname",
        least: 0,
        most: 0,
        usage: "GETNAME",
        what: "Return the name of the current connection.",
        traits: CONNECTION,
    },
    Subcommand {
        name: "client|id",
        least: 0,
        most: 0,
        usage: "ID",
        what: "Return the ID of the current connection.",
        traits: CONNECTION,
    },
    Subcommand {
        name: "client|info",
        least: 0,
        most: 0,
        usage: "INFO",
        what: "Return information about the current connection, as a line of CLIENT LIST.",
        traits: CONNECTION.tips("nondeterministic_output"),
    },
    Subcommand {
        name: "client|kill",
        least: 1,
        most: usize::MAX,
        usage: "KILL <ip:port> | <filter> [value] ... [<filter> [value] ...]",
        what: "Close the connection at <ip:port>, or those the filters choose: ID <id>, ADDR <ip:port>,|LADDR <ip:port>, TYPE NORMAL, USER DEFAULT, SKIPME YES or NO (YES, unless given: not the one asking).",
        traits: CLIENT_ADMIN,
    },
    Subcommand {
        name: "client|list",
        least: 0,
        most: usize::MAX,
        usage: "LIST [TYPE <type> | ID <id> [<id> ...]]",
        what: "Return information about the connections, one line each.",
        traits: CLIENT_ADMIN.tips("nondeterministic_output"),
    },
    Subcommand {
        name: "client|setinfo",
        least: 2,
        most: 2,
        usage: "SETINFO LIB-NAME|LIB-VER <value>",
        what: "Note the name or version of the client library, shown in CLIENT LIST.",
        traits: CONNECTION,
    },
    Subcommand {
        name: "client|setname",
        least: 1,
        most: 1,
        usage: "SETNAME <name>",
        what: "Name the current connection.",
        traits: CONNECTION,
    },
    Subcommand {
        name: "cluster|countkeysinslot",
        least: 1,
        most: 1,
        usage: "COUNTKEYSINSLOT <slot>",
        what: "Return the number of keys held of <slot> (all the keys are looked through).",
        traits: CLUSTER,
    },
    Subcommand {
        name: "cluster|getkeysinslot",
        least: 2,
        most: 2,
        usage: "GETKEYSINSLOT <slot> <count>",
        what: "Return up to <count> keys held of <slot> (all the keys are looked through).",
        traits: CLUSTER.tips("nondeterministic_output"),
    },
    Subcommand {
        name: "cluster|info",
        least: 0,
        most: 0,
        usage: "INFO",
        what: "Return the state of the cluster: every slot served, by the nodes listed.",
        traits: CLUSTER.tips("nondeterministic_output"),
    },
    Subcommand {
        name: "cluster|keyslot",
        least: 1,
        most: 1,
        usage: "KEYSLOT <key>",
        what: "Return the hash slot of <key>.",
        traits: CLUSTER,
    },
    Subcommand {
        name: "cluster|myid",
        least: 0,
        most: 0,
        usage: "MYID",
        what: "Return this node's id.",
        traits: CLUSTER,
    },
    Subcommand {
        name: "cluster|nodes",
        least: 0,
        most: 0,
        usage: "NODES",
        what: "Return the nodes, a line each: <id> <ip:port@bus-port> <flags> <master> <pings>|<pongs> <epoch> <link> <slots>.",
        traits: CLUSTER.tips("nondeterministic_output"),
    },
    Subcommand {
        name: "cluster|shards",
        least: 0,
        most: 0,
        usage: "SHARDS",
        what: "Return the shards: each node's slots, and the node.",
        traits: CLUSTER.tips("nondeterministic_output"),
    },
    Subcommand {
        name: "cluster|slots",
        least: 0,
        most: 0,
        usage: "SLOTS",
        what: "Return each node's range of slots, and its address, port and id.",
        traits: CLUSTER.tips("nondeterministic_output"),
    },
    Subcommand {
        name: "command|count",
        least: 0,
        most: 0,
        usage: "COUNT",
        what: "Return the number of commands served.",
        traits: COMMAND_SUB,
    },
    Subcommand {
        name: "command|docs",
        least: 0,
        most: usize::MAX,
        usage: "DOCS [<command> ...]",
        what: "Return an empty map: the commands' documentation is not kept.",
        traits: COMMAND_SUB.tips("nondeterministic_output_order"),
    },
    Subcommand {
        name: "command|getkeys",
        least: 2,
        most: usize::MAX,
        usage: "GETKEYS <full-command>",
        what: "Return the keys the command given, with its arguments, names.",
        traits: COMMAND_SUB,
    },
    Subcommand {
        name: "command|info",
        least: 0,
        most: usize::MAX,
        usage: "INFO [<command> ...]",
        what: "Return the details of the commands named (all served, unless named): arity,|flags, where their keys are, ACL categories, tips, key specifications, subcommands.",
        traits: COMMAND_SUB.tips("nondeterministic_output_order"),
    },
    Subcommand {
        name: "command|list",
        least: 0,
        most: usize::MAX,
        usage: "LIST [FILTERBY (MODULE <module-name>|ACLCAT <category>|PATTERN <pattern>)]",
        what: "Return the names of the commands served, or of those the filter keeps.",
        traits: COMMAND_SUB.tips("nondeterministic_output_order"),
    },
    Subcommand {
        name: "config|get",
        least: 1,
        most: usize::MAX,
        usage: "GET <pattern> [<pattern> ...]",
        what: "Return the settings whose names match the patterns.",
        traits: ADMIN,
    },
    Subcommand {
        name: "config|resetstat",
        least: 0,
        most: 0,
        usage: "RESETSTAT",
        what: "Refused: the settings live in the pipeline file.",
        traits: ADMIN,
    },
    Subcommand {
        name: "config|rewrite",
        least: 0,
        most: 0,
        usage: "REWRITE",
        what: "Refused: the settings live in the pipeline file.",
        traits: ADMIN,
    },
    Subcommand {
        name: "config|set",
        least: 2,
        most: usize::MAX,
        usage: "SET <name> <value> [<name> <value> ...]",
        what: "Refused: the settings live in the pipeline file.",
        traits: ADMIN.tips("request_policy:all_nodes response_policy:all_succeeded"),
    },
    Subcommand {
        name: "latency|history",
        least: 1,
        most: 1,
        usage: "HISTORY <event>",
        what: "Return nothing: the latency monitor is off.",
        traits: ADMIN.tips("nondeterministic_output request_policy:all_nodes response_policy:special"),
    },
    Subcommand {
        name: "latency|latest",
        least: 0,
        most: 0,
        usage: "LATEST",
        what: "Return nothing: the latency monitor is off.",
        traits: ADMIN.tips("nondeterministic_output request_policy:all_nodes response_policy:special"),
    },
    Subcommand {
        name: "latency|reset",
        least: 0,
        most: usize::MAX,
        usage: "RESET [<event> ...]",
        what: "Return 0: the latency monitor is off.",
        traits: ADMIN.tips("request_policy:all_nodes response_policy:all_succeeded"),
    },
    Subcommand {
        name: "memory|usage",
        least: 1,
        most: 3,
        usage: "USAGE <key> [SAMPLES <count>]",
        what: "Return the bytes a value takes on the target, its blocks, and its key's.",
        traits: traits("readonly", "@read @slow", "", MEMORY_USAGE_KEY),
    },
    // More than a count is refused by `SlowLog::command`, in Redis's words.
    Subcommand {
        name: "slowlog|get",
        least: 0,
        most: usize::MAX,
        usage: "GET [<count>]",
        what: "Return the <count> newest entries of the slow log (10 unless given, -1 for all):|id, unix time, microseconds, arguments, client address and name.",
        traits: SLOWLOG.tips("request_policy:all_nodes nondeterministic_output"),
    },
    Subcommand {
        name: "slowlog|len",
        least: 0,
        most: 0,
        usage: "LEN",
        what: "Return the number of entries in the slow log.",
        traits: SLOWLOG.tips("request_policy:all_nodes response_policy:agg_sum nondeterministic_output"),
    },
    Subcommand {
        name: "slowlog|reset",
        least: 0,
        most: 0,
        usage: "RESET",
        what: "Empty the slow log.",
        traits: SLOWLOG.tips("request_policy:all_nodes response_policy:all_succeeded"),
    },
];

/// The arity and traits of the command `name` (lowercase), or of its subcommand `sub`
/// where it has that one; `None` for a command not served.
pub(super) fn lookup(name: &str, sub: Option<&[u8]>) -> Option<(i64, Traits)> {
    let c = &CATALOG[CATALOG.binary_search_by(|c| c.name.cmp(name)).ok()?];
    let named = |s: &&Subcommand| {
        let its = s.name.split_once('|').map_or("", |(_, its)| its);
        sub.is_some_and(|sub| its.as_bytes().eq_ignore_ascii_case(sub))
    };
    match subcommands_of(name).iter().find(named) {
        Some(s) => Some((s.arity(), s.traits)),
        None => Some((c.arity, c.traits)),
    }
}

/// The subcommands of the command `name`, together in the sorted [`SUBCOMMANDS`].
pub(super) fn subcommands_of(name: &str) -> &'static [Subcommand] {
    let of_it = |s: &Subcommand| s.name.split_once('|').is_some_and(|(c, _)| c == name);
    let from = SUBCOMMANDS.iter().position(of_it).unwrap_or(0);
    let n = SUBCOMMANDS[from..].iter().take_while(|s| of_it(s)).count();
    &SUBCOMMANDS[from..from + n]
}

/// Whether a request of `words` words, its name included, has a number `arity` allows.
pub(super) fn arity_holds(arity: i64, words: usize) -> bool {
    match usize::try_from(arity) {
        Ok(n) => words == n,
        Err(_) => words as u64 >= arity.unsigned_abs(),
    }
}

/// The names of the commands of [`CATALOG`], in its order.
pub(super) const fn names() -> [&'static str; CATALOG.len()] {
    let mut names = [""; CATALOG.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = CATALOG[i].name;
        i += 1;
    }
    names
}

/// Appends `COMMAND INFO`'s entry of a command (`subcommands` of it listed in it) to
/// `out`: name, arity, flags, first key, last key and step, ACL categories, tips, key
/// specifications, subcommands; sets and maps in RESP3 as Redis writes them.
pub(super) fn describe(
    out: &mut Vec<u8>,
    name: &str,
    arity: i64,
    t: &Traits,
    subcommands: &[Subcommand],
    proto: Proto,
) {
    reply::array(out, 10);
    reply::bulk(out, name.as_bytes());
    reply::integer(out, arity);
    simple_set(out, t.flags, proto);
    for n in t.keys.map_or([0; 3], |k| k.classic()) {
        reply::integer(out, n);
    }
    simple_set(out, t.acl, proto);
    // Tips are bulk strings.
    reply::set(out, t.tips.split_whitespace().count(), proto);
    for tip in t.tips.split_whitespace() {
        reply::bulk(out, tip.as_bytes());
    }
    let specs = usize::from(t.keys.is_some()) + usize::from(t.keyword_keys.is_some());
    reply::set(out, specs, proto);
    if let Some(k) = t.keys {
        begin_search(out, k.access, b"index", 1, proto);
        reply::bulk(out, b"index");
        reply::integer(out, k.begin);
        range(out, k.last, k.step, proto);
    }
    if let Some(k) = t.keyword_keys {
        begin_search(out, k.access, b"keyword", 2, proto);
        reply::bulk(out, b"keyword");
        reply::bulk(out, k.keyword.as_bytes());
        reply::bulk(out, b"startfrom");
        reply::integer(out, k.from);
        range(out, -1, 1, proto);
    }
    reply::set(out, subcommands.len(), proto);
    for s in subcommands {
        describe(out, s.name, s.arity(), &s.traits, &[], proto);
    }
}

/// A key specification up to its `begin_search` spec's `fields` fields, which follow:
/// its flags (`access`), and a search of `kind`.
fn begin_search(out: &mut Vec<u8>, access: &str, kind: &[u8], fields: usize, proto: Proto) {
    reply::map(out, 3, proto);
    reply::bulk(out, b"flags");
    simple_set(out, access, proto);
    reply::bulk(out, b"begin_search");
    reply::map(out, 2, proto);
    reply::bulk(out, b"type");
    reply::bulk(out, kind);
    reply::bulk(out, b"spec");
    reply::map(out, fields, proto);
}

/// A key specification's `find_keys` of every `step`th argument up to `last` (negative:
/// counted from the end).
fn range(out: &mut Vec<u8>, last: i64, step: i64, proto: Proto) {
    reply::bulk(out, b"find_keys");
    reply::map(out, 2, proto);
    reply::bulk(out, b"type");
    reply::bulk(out, b"range");
    reply::bulk(out, b"spec");
    reply::map(out, 3, proto);
    for (field, n) in [("lastkey", last), ("keystep", step), ("limit", 0)] {
        reply::bulk(out, field.as_bytes());
        reply::integer(out, n);
    }
}

/// A set of simple strings, of the words of `items`: flags, ACL categories.
fn simple_set(out: &mut Vec<u8>, items: &str, proto: Proto) {
    reply::set(out, items.split_whitespace().count(), proto);
    for i in items.split_whitespace() {
        reply::simple(out, i);
    }
}
