//! State-machine transitions on a business row: stale and early messages told apart from
//! illegal ones, with one guarded UPDATE.
//!
//! A ride must never move back to "driver departed" when that message arrives after
//! "driver arrived". Declare the states and their allowed successors; pgbox derives from the
//! (acyclic) graph which states come before which, and [`StateTable::transition`] answers:
//!
//! | result | meaning | consumer does |
//! |---|---|---|
//! | `Applied { from }` | moved from an allowed predecessor | commit, ack |
//! | `AlreadyInState` | a replay: already there, nothing written | commit, ack |
//! | `Stale { current }` | an older message: the row is past it | skip, ack |
//! | `TooEarly { current }` | arrived before its predecessor | redeliver later |
//! | `Illegal { current }` | no path either way: a bug or bad data | error / dead-letter |
//! | `NotFound` | no such row | per business rule |

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;

use sqlx::postgres::PgArguments;
use sqlx::{Arguments, AssertSqlSafe, Encode, Postgres, Row, Type};

use crate::error::{Error, Result};
use crate::ident::{Identifier, TableRef};
use crate::inbox::ConnectionLike;

/// A set of states stored as text, and which transitions between them are allowed.
///
/// ```
/// #[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// enum Order { Created, Paid, Shipped, Cancelled }
///
/// impl pgbox::StateMachine for Order {
///     const STATES: &'static [Self] = &[Order::Created, Order::Paid, Order::Shipped, Order::Cancelled];
///     fn name(self) -> &'static str {
///         match self {
///             Order::Created => "created",
///             Order::Paid => "paid",
///             Order::Shipped => "shipped",
///             Order::Cancelled => "cancelled",
///         }
///     }
///     fn next(self) -> &'static [Self] {
///         match self {
///             Order::Created => &[Order::Paid, Order::Cancelled],
///             Order::Paid => &[Order::Shipped, Order::Cancelled],
///             Order::Shipped | Order::Cancelled => &[],
///         }
///     }
/// }
/// let orders = pgbox::StateTable::<Order>::new("orders").unwrap();
/// ```
pub trait StateMachine: Copy + Eq + fmt::Debug + Send + Sync + 'static {
    /// Every state, each once.
    const STATES: &'static [Self];
    /// The text stored in the status column. Unique per state, non-empty.
    fn name(self) -> &'static str;
    /// The states this one may move to directly. The graph must be acyclic, so that "older"
    /// and "newer" are well defined.
    fn next(self) -> &'static [Self];
}

/// What [`StateTable::transition`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Transition<S> {
    /// The row moved from `from` to the requested state.
    Applied {
        /// The state before.
        from: S,
    },
    /// The row already is in the requested state (a replayed message). Nothing written.
    AlreadyInState,
    /// The row is already past the requested state: an older message. Nothing written.
    Stale {
        /// The row's state.
        current: S,
    },
    /// The requested state is ahead, but not directly: a predecessor message is missing so
    /// far. Nothing written; redeliver later.
    TooEarly {
        /// The row's state.
        current: S,
    },
    /// No path leads from the row's state to the requested one or back: an error.
    Illegal {
        /// The row's state.
        current: S,
    },
    /// No row with that id.
    NotFound,
}

/// The graph facts derived once from a [`StateMachine`].
#[derive(Debug)]
struct Graph {
    index: HashMap<&'static str, usize>,
    /// `reach[a][b]`: b can be reached from a in one or more steps.
    reach: Vec<Vec<bool>>,
    /// Names of the direct predecessors of each state.
    predecessors: Vec<Vec<&'static str>>,
}

impl Graph {
    fn new<S: StateMachine>() -> Result<Self> {
        let states = S::STATES;
        let mut index = HashMap::new();
        for (i, s) in states.iter().enumerate() {
            let name = s.name();
            if name.is_empty() || name.contains('\0') {
                return Err(Error::InvalidStateMachine(format!(
                    "state {s:?} has an unusable name {name:?}"
                )));
            }
            if index.insert(name, i).is_some() {
                return Err(Error::InvalidStateMachine(format!(
                    "two states are named {name:?}"
                )));
            }
        }
        let n = states.len();
        let mut reach = vec![vec![false; n]; n];
        let mut predecessors = vec![Vec::new(); n];
        for (i, s) in states.iter().enumerate() {
            for t in s.next() {
                let j = *index.get(t.name()).ok_or_else(|| {
                    Error::InvalidStateMachine(format!("{s:?} -> {t:?}: {t:?} is not in STATES"))
                })?;
                reach[i][j] = true;
                predecessors[j].push(s.name());
            }
        }
        // Transitive closure (Floyd–Warshall); state machines are small.
        for k in 0..n {
            let via_k = reach[k].clone();
            for row in reach.iter_mut().filter(|row| row[k]) {
                for (cell, &through) in row.iter_mut().zip(&via_k) {
                    *cell |= through;
                }
            }
        }
        if let Some(i) = (0..n).find(|&i| reach[i][i]) {
            return Err(Error::InvalidStateMachine(format!(
                "{:?} can reach itself; the transition graph must be acyclic",
                states[i]
            )));
        }
        Ok(Graph {
            index,
            reach,
            predecessors,
        })
    }
}

/// A table with a text status column driven by the state machine `S`.
#[derive(Debug)]
pub struct StateTable<S> {
    table: TableRef,
    id: Identifier,
    status: Identifier,
    graph: Graph,
    states: PhantomData<S>,
}

impl<S: StateMachine> StateTable<S> {
    /// The table `name` with columns `id` and `status`; validates the state machine.
    pub fn new(name: &str) -> Result<Self> {
        Ok(StateTable {
            table: TableRef::new(name)?,
            id: Identifier::new("column", "id")?,
            status: Identifier::new("column", "status")?,
            graph: Graph::new::<S>()?,
            states: PhantomData,
        })
    }

    /// Qualifies the table with a schema.
    pub fn schema(mut self, schema: &str) -> Result<Self> {
        self.table = self.table.in_schema(schema)?;
        Ok(self)
    }

    /// The primary-key column (default `id`).
    pub fn id_column(mut self, column: &str) -> Result<Self> {
        self.id = Identifier::new("column", column)?;
        Ok(self)
    }

    /// The status column (default `status`), of type `text`.
    pub fn status_column(mut self, column: &str) -> Result<Self> {
        self.status = Identifier::new("column", column)?;
        Ok(self)
    }

    fn qualified(&self) -> String {
        self.table.to_string()
    }

    /// A stored status as a state. NULL and values that are not states are typed errors, the
    /// same for [`transition`](Self::transition) and [`current`](Self::current).
    fn parse(&self, value: Option<&str>) -> Result<S> {
        let Some(value) = value else {
            return Err(Error::NullState {
                table: self.qualified(),
            });
        };
        self.graph
            .index
            .get(value)
            .map(|&i| S::STATES[i])
            .ok_or_else(|| Error::UnknownState {
                table: self.qualified(),
                value: value.to_owned(),
            })
    }

    /// Where `state` sits in the graph; a state missing from `STATES` is a typed error.
    fn index_of(&self, state: S) -> Result<usize> {
        self.graph
            .index
            .get(state.name())
            .copied()
            .filter(|&i| S::STATES[i] == state)
            .ok_or_else(|| {
                Error::InvalidStateMachine(format!(
                    "{state:?} is not in STATES (named {:?})",
                    state.name()
                ))
            })
    }

    /// Moves row `id` to `to` if its current state is a direct predecessor of `to`.
    ///
    /// One statement: it locks the row (`FOR UPDATE`), so concurrent transitions of one row
    /// serialize, and updates it only `WHERE status = ANY(predecessors of to)`.
    pub async fn transition<'q, I>(
        &self,
        conn: &mut impl ConnectionLike,
        id: I,
        to: S,
    ) -> Result<Transition<S>>
    where
        I: Encode<'q, Postgres> + Type<Postgres> + Clone + 'q,
    {
        let to_index = self.index_of(to)?;
        let (t, id_col, status) = (self.qualified(), &self.id, &self.status);
        let sql = format!(
            "WITH current AS (SELECT {status}::text AS status FROM {t} WHERE {id_col} = $1 FOR UPDATE), \
             updated AS (UPDATE {t} SET {status} = $2 \
                 WHERE {id_col} = $1 AND {status} = ANY($3) AND EXISTS (SELECT 1 FROM current) \
                 RETURNING 1) \
             SELECT EXISTS (SELECT 1 FROM current), (SELECT status FROM current), EXISTS (SELECT 1 FROM updated)"
        );
        // The UPDATE filters on the statement's snapshot, while `current` is read after the row
        // lock, at the newest version. When a concurrent transaction moved the row to a
        // predecessor of `to` while this statement waited for its lock, the two disagree: the
        // row is now ours (locked) and in an allowed state, but was not updated. Run the
        // statement again: under READ COMMITTED its new snapshot sees that commit. Under
        // REPEATABLE READ the lock wait itself fails with a (retryable) serialization error.
        let mut rounds = 0;
        let (current, applied) = loop {
            rounds += 1;
            let mut args = PgArguments::default();
            args.add(id.clone()).map_err(sqlx::Error::Encode)?;
            args.add(to.name()).map_err(sqlx::Error::Encode)?;
            args.add(&self.graph.predecessors[to_index])
                .map_err(sqlx::Error::Encode)?;
            let row = sqlx::query_with(AssertSqlSafe(sql.clone()), args)
                .persistent(conn.persistent())
                .fetch_one(conn.connection())
                .await;
            if row.is_err() {
                conn.statement_failed();
            }
            let row = row?;
            let exists: bool = row.try_get(0)?;
            let current: Option<String> = row.try_get(1)?;
            let applied: bool = row.try_get(2)?;
            if !exists {
                return Ok(Transition::NotFound);
            }
            let current = self.parse(current.as_deref())?;
            let raced = !applied
                && self.graph.predecessors[to_index].contains(&current.name())
                && rounds < 3;
            if !raced {
                break (current, applied);
            }
            tracing::debug!(table = %t, ?current, ?to, "pgbox transition waited for a concurrent one; re-reading");
        };
        let result = if applied {
            Transition::Applied { from: current }
        } else if current == to {
            Transition::AlreadyInState
        } else {
            let c = self.index_of(current)?;
            if self.graph.reach[to_index][c] {
                Transition::Stale { current }
            } else if self.graph.reach[c][to_index] {
                Transition::TooEarly { current }
            } else {
                Transition::Illegal { current }
            }
        };
        match result {
            Transition::Applied { from } => {
                tracing::debug!(table = %t, ?from, ?to, "pgbox transition applied")
            }
            Transition::Illegal { current } => {
                tracing::warn!(table = %t, ?current, ?to, "pgbox illegal transition refused")
            }
            other => tracing::info!(table = %t, ?to, result = ?other, "pgbox transition skipped"),
        }
        Ok(result)
    }

    /// The row's current state, `None` if there is no such row.
    pub async fn current<'q, I>(&self, conn: &mut impl ConnectionLike, id: I) -> Result<Option<S>>
    where
        I: Encode<'q, Postgres> + Type<Postgres> + 'q,
    {
        let sql = format!(
            "SELECT {}::text FROM {} WHERE {} = $1",
            self.status,
            self.qualified(),
            self.id
        );
        let mut args = PgArguments::default();
        args.add(id).map_err(sqlx::Error::Encode)?;
        let value = sqlx::query_scalar_with(AssertSqlSafe(sql), args)
            .persistent(conn.persistent())
            .fetch_optional(conn.connection())
            .await;
        if value.is_err() {
            conn.statement_failed();
        }
        let value: Option<Option<String>> = value?;
        value.map(|v| self.parse(v.as_deref())).transpose()
    }
}
