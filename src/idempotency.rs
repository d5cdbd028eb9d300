//! An `Idempotency-Key` layer for HTTP routes (axum/tower), backed by the inbox: a retried
//! `POST` gets the first attempt's response instead of a second effect.
//!
//! Feature `axum`. Semantics follow the IETF draft "The Idempotency-Key HTTP Header Field"
//! (draft-ietf-httpapi-idempotency-key-header) and Stripe's documented behaviour, with the
//! differences said below.
//!
//! ```no_run
//! use axum::Router;
//! use axum::extract::Path;
//! use axum::http::StatusCode;
//! use axum::response::{IntoResponse, Response};
//! use axum::routing::post;
//! use pgbox::Inbox;
//! use pgbox::idempotency::{IdempotencyLayer, IdempotencyTx};
//!
//! /// `POST /orders/{id}/pay`: its effects and its stored response commit together.
//! async fn pay(Path(id): Path<i64>, tx: IdempotencyTx) -> Result<Response, StatusCode> {
//!     let failed = |_| StatusCode::INTERNAL_SERVER_ERROR;
//!     let mut tx = tx.lock().await.map_err(failed)?;
//!     let paid = sqlx::query("UPDATE orders SET status = 'paid' WHERE id = $1 AND status = 'new'")
//!         .bind(id)
//!         .execute(&mut **tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(match paid.rows_affected() {
//!         1 => (StatusCode::OK, "paid").into_response(),
//!         // Not stored by default: a retry after the order exists runs again.
//!         _ => (StatusCode::NOT_FOUND, "no such unpaid order").into_response(),
//!     })
//! }
//!
//! # async fn f(pool: sqlx::PgPool) -> Result<(), pgbox::Error> {
//! let layer = IdempotencyLayer::builder(pool, Inbox::new("pay-requests")?)
//!     // Keys are per client: two clients' "1" never meet.
//!     .scope(|request| {
//!         request
//!             .headers
//!             .get("x-account-id")
//!             .and_then(|v| v.to_str().ok())
//!             .map(str::to_owned)
//!     })
//!     .build()?;
//! let app: Router = Router::new().route("/orders/{id}/pay", post(pay).route_layer(layer));
//! # let _ = app; Ok(()) }
//! ```
//!
//! # How a handler gets the transaction, and why
//!
//! For a request with a key, the layer begins a transaction, claims the key in it (the
//! inbox's `INSERT … ON CONFLICT`, keyed by the layer's inbox consumer), and hands that
//! transaction to the handler as the [`IdempotencyTx`] extractor. After the handler returns,
//! the layer decides whether the response is final (below): if so it stores the response
//! (status, [selected headers](IdempotencyBuilder::store_header), body) on the claim's inbox
//! row and commits, so **the response is stored if and only if the handler's effects
//! committed**; if not, it rolls back, so neither the effects nor the key remain and a retry
//! runs the handler again. A layer, rather than a closure API, because it fits any existing
//! handler (extractors, state, `IntoResponse`) and any route; the transaction travels in the
//! request's extensions because that is how a tower layer can hand something to an axum
//! handler.
//!
//! **The handler cannot end the transaction.** `&mut **tx` is a [`LayerConnection`], which
//! screens statements as the inbox's [`HandlerConnection`] does:
//! each goes out alone with the extended protocol (the server refuses `SELECT 1; COMMIT`),
//! and `BEGIN`, `COMMIT`, `END`, `ROLLBACK`, `ABORT`, `PREPARE TRANSACTION` are refused with
//! an error before they are sent. Nested units of work (`tx.begin()`) are savepoints. What is
//! not screened is the raw connection (`&mut ***tx`) and a nested unit's own connection;
//! before storing or committing, the layer checks that the connection is still in the
//! transaction it began (its id) and that no nested unit was left open, and answers 500 with
//! nothing stored otherwise. Transaction control sent there may already have committed what
//! the handler did before it: the 500 says so ("Transaction ended by the handler"), and so
//! does every retry of that key ("Idempotency key used without a stored response"), which
//! neither replays nor runs again.
//!
//! Effects the handler makes elsewhere (other pools, other services) are not covered: they
//! happen once per run, and a run is repeated only when the previous one stored nothing.
//!
//! # Semantics
//!
//! | case | answer | stored? |
//! | --- | --- | --- |
//! | key missing, [`required`](IdempotencyBuilder::required) (the default) | 400, problem JSON | no |
//! | key missing, not required | the handler runs in a layer transaction, committed when the response is final | no |
//! | key empty, longer than [`max_key_len`](IdempotencyBuilder::max_key_len) (255), not visible ASCII (a space, a control character, non-ASCII), or sent twice | 400, problem JSON saying which rule failed | no |
//! | key sent, but the [scope](IdempotencyBuilder::scope) function finds no client | 401, problem JSON | no |
//! | request body over [`max_request_bytes`](IdempotencyBuilder::max_request_bytes) | 413 | no |
//! | first request, handler answers 2xx or 3xx | the handler's response | yes |
//! | first request, handler answers a final 4xx (400, 402, 405, 410, 413, 422, …) | the handler's response | yes |
//! | first request, handler answers 401, 403, 404, 406, 408, 409, 411, 412, 415, 423, 424, 425, 428 or 429 | the handler's response; its effects roll back | no |
//! | first request, handler answers 5xx, fails or panics | the handler's response; its effects roll back | no |
//! | first request, handler sent transaction control or several statements through `&mut **tx` | the handler got an error for it; the transaction goes on | as the handler then answers |
//! | first request, handler swallowed a failed statement, or left a nested unit open | 500, problem JSON; nothing commits | no |
//! | first request, handler ended the transaction on the raw connection | 500 "Transaction ended by the handler"; what ran before the end may have committed | no; retries get 500 "Idempotency key used without a stored response" if the key's row committed |
//! | first request, final response body over [`max_response_bytes`](IdempotencyBuilder::max_response_bytes) | 500, problem JSON; its effects roll back | no |
//! | same key, same request, after the first committed | the stored response, plus `Idempotent-Replayed: true` | (already) |
//! | same key, another method, path, query or body | 422, problem JSON | no |
//! | same key while the first is in flight | waits for it, then as above (the inbox's default [`Wait::Block`](crate::Wait::Block)); 409 with `Retry-After: 1` once the inbox's [`Wait::Timeout`](crate::Wait::Timeout) expires, or at once with [`Wait::NoWait`](crate::Wait::NoWait) | no |
//! | same key after the retention window, once purged | runs again, as a first request | yes |
//! | a [`Finality`] part in the response | overrides the status rule (never for 5xx) | as it says |
//!
//! **Which responses are stored.** Stripe saves a result only once the endpoint began
//! executing, and not when the request failed validation before execution or conflicted with
//! a concurrent one; the draft leaves the choice to the server. Here a response is stored when
//! it is *final*: the same request (what the fingerprint covers) would get the same answer
//! later. 2xx and 3xx are final; 4xx are final except those whose answer depends on something
//! outside the fingerprint (credentials 401/403; `Accept`, `Content-Type`, length and
//! precondition headers 406/411/412/415/428) or may change with time (404: the resource may
//! be created; 408, 409, 423, 424, 425, 429: transient). 5xx is never stored, unlike Stripe,
//! which replays its 500s: here a 5xx rolled back the handler's transaction, so nothing
//! happened and running again is the honest answer. A handler that knows better says so with
//! [`Finality`] (e.g. a 409 "already paid" that is final), or the rule is replaced with
//! [`IdempotencyBuilder::is_final`].
//!
//! **The fingerprint** is a SHA-256 of the method, the path with its query as the client sent
//! it, and the body bytes; headers are not part of it. A key reused for a different request
//! is refused with 422 (the draft's answer), never replayed. The path is the whole one
//! wherever the layer sits: a route under `Router::nest` (or `nest_service`) sees its URI
//! without the nest's prefix, so the layer takes axum's [`OriginalUri`], which the outermost
//! `Router` records; `POST /accounts/1/charges` and `POST /accounts/2/charges` are two
//! requests whether the layer is a `layer` or a `route_layer`, on the route, on a nested or
//! merged router, or on a fallback. Outside a `Router` (a plain tower stack that rewrites
//! paths before the layer), the layer sees only the URI it is given: put it outside such
//! rewriting.
//!
//! **Keys** are the header's value, verbatim: 1 to
//! [`max_key_len`](IdempotencyBuilder::max_key_len) (default 255, as Stripe) visible ASCII
//! characters, 0x21 to 0x7E. The draft's quoted
//! structured-field form (`"8e03…"`) is accepted as is (its quotes are visible ASCII). The
//! 400 names the rule and what broke it.
//!
//! **Scope.** The inbox row's key is the [scope](IdempotencyBuilder::scope) and the
//! client's key together, `<scope length>:<scope>:<key>` (`0::<key>` without a scope; a scope
//! over 256 bytes as `#<its SHA-256>:<key>`), in the layer's inbox consumer (one key space
//! per layer: give each layer an inbox consumer of its own). Without a scope function, every
//! client of the layer shares one key space, and one client could be answered with another's
//! response: set one that returns the authenticated principal (a stable account id, not a
//! token that rotates) whenever more than one client calls the route.
//!
//! **Expiry.** Keys are remembered at least the [retention](IdempotencyBuilder::retention)
//! window (default 24 hours, as Stripe) and forgotten when the inbox rows are purged: by
//! [`IdempotencyLayer::purge_expired`], or by the [`Janitor`](crate::janitor::Janitor) with
//! `consumer_retention(layer.inbox().consumer(), retention)`. A key sent again after its
//! purge runs as a first request.
//!
//! **Replays** carry the stored status, the stored headers (by default `content-type`,
//! `content-encoding`, `content-language` and `location`; never `set-cookie`) and the stored
//! body, byte for byte (a header value that is not UTF-8, such as a Latin-1 `Location`, is
//! stored as hex), plus `Idempotent-Replayed: true` (the header Stripe uses). The first response goes
//! out with all its headers. Responses that are stored are buffered (at most
//! [`max_response_bytes`](IdempotencyBuilder::max_response_bytes), else 500 and roll back),
//! and so are requests with a key (for the fingerprint).
//!
//! **In flight.** With the inbox's default [`Wait::Block`](crate::Wait::Block), a second
//! request with the same key waits on the first one's claim (holding a pool connection) and
//! then gets its stored response, or runs itself if the first stored nothing: a client that
//! retries too early still gets the answer, and one whose first attempt timed out on its
//! side does not have to poll. The draft's 409 is there for those who prefer it:
//! [`Wait::NoWait`](crate::Wait::NoWait) answers it at once, and
//! [`Wait::Timeout`](crate::Wait::Timeout) after a bounded wait (a pool-friendly default for
//! slow handlers).
//!
//! **Database encoding.** On a database whose encoding is not UTF-8 (LATIN1, SQL_ASCII, …),
//! which may have no character for a UTF-8 one, the layer writes only ASCII: a body or a
//! stored header value that is not ASCII is stored as hex (replayed byte for byte all the
//! same), a non-ASCII request line is escaped, and a scope that is not ASCII is keyed by its
//! SHA-256 (`#<hash>:<key>`). The layer reads `server_encoding` once, on its first request
//! with a key.
//!
//! **Isolation.** The layer's transaction begins at the pool's default level, so a handler
//! on a database (or role, or `after_connect`) whose default is `REPEATABLE READ` or
//! `SERIALIZABLE` runs at that level. There a waiting claim fails with a serialization error
//! when the first request commits (the key's row is newer than its snapshot); the layer then
//! claims again in a new transaction, which sees the row and replays it, as at `READ
//! COMMITTED`. A serialization failure of the handler's own statements or of the COMMIT is a
//! 5xx like any other: nothing committed, and the retry runs again.
//!
//! **Behind a pooler in transaction mode** (PgBouncer), build the inbox with
//! [`Pooler::Transaction`]: the claim and the stored response are
//! unnamed statements in the layer's transaction, the keyless request's transaction id (read
//! when it begins) and the check before its COMMIT use the simple protocol, and [`IdempotencyLayer::purge_expired`] runs each batch
//! in a transaction of its own. The handler's own statements are its to mark
//! `.persistent(false)`, on a pool that never ran a named statement. Through `&mut **tx`
//! every text is a prepared statement (that is how the server refuses a second statement in
//! it): `raw_sql` an unnamed one, a plain `&str` a named one (sqlx's default for it), so
//! behind such a pooler use `sqlx::query(…).persistent(false)` or `raw_sql`.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{FromRequestParts, OriginalUri, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTransactionManager, PgTypeInfo};
use sqlx::{
    AssertSqlSafe, Either, Execute, Executor, PgConnection, PgPool, Postgres, Row, SqlStr,
    Transaction,
};
use sqlx_core::describe::Describe;
use sqlx_core::ext::async_stream::TryAsyncStream;
use sqlx_core::transaction::TransactionManager;
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use tower::{Layer, Service};

use crate::HandlerConnection;
use crate::error::{DbErrorKind, Error, Result};
use crate::inbox::{Claim, Claimed, Duplicate, Inbox};
use crate::pooler::Pooler;

/// The request header carrying the key (the draft's name).
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// The response header that marks a replay, with the value `true` (Stripe's name).
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";

/// Default longest key, in characters: 255, as Stripe.
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// The longest key [`IdempotencyBuilder::max_key_len`] accepts: 512 characters, so that a
/// key with its scope always fits the inbox's key limit ([`MAX_KEY_BYTES`](crate::MAX_KEY_BYTES)).
pub const MAX_KEY_LEN: usize = 512;

/// Default largest request body read for the fingerprint: 2 MiB (axum's default body limit).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 2 * 1024 * 1024;

/// Default largest response body stored: 1 MiB (it is kept in the inbox row, as JSON).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// Default retention window of keys: 24 hours, as Stripe.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// A scope longer than this (in bytes) is replaced by its SHA-256 in the inbox key.
const MAX_SCOPE_BYTES: usize = 256;

/// The version of the stored response's JSON, for readers of older rows. (`headers_hex` was
/// added to version 1 without a bump: readers that predate it ignore it.)
const STORED_FORMAT: u32 = 1;

/// Claims of one request at most, when a claim fails with a serialization error: see
/// `run_with_key`.
const CLAIM_ATTEMPTS: u32 = 3;

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type FinalFn = dyn Fn(StatusCode) -> bool + Send + Sync;

/// Whether a response is a final answer, overriding the layer's status rule
/// ([`is_final_by_default`]) for this one response. Put it in the response's parts:
/// `(StatusCode::CONFLICT, Finality::Final, body)`. A 5xx is never stored, whatever it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finality {
    /// The answer stands for good: store it with the effects and replay it to retries.
    Final,
    /// The answer may change (or depends on something the fingerprint does not cover): roll
    /// the handler's transaction back and let a retry run again.
    Retryable,
}

impl IntoResponseParts for Finality {
    type Error = Infallible;

    fn into_response_parts(
        self,
        mut res: ResponseParts,
    ) -> std::result::Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

impl IntoResponse for Finality {
    fn into_response(self) -> Response {
        (self, ()).into_response()
    }
}

/// The layer's rule for responses without a [`Finality`]: 2xx and 3xx are final; 4xx are
/// final except 401, 403, 404, 406, 408, 409, 411, 412, 415, 423, 424, 425, 428 and 429;
/// 1xx and 5xx never are. See the [module docs](self) for why.
pub fn is_final_by_default(status: StatusCode) -> bool {
    match status.as_u16() {
        200..=399 => true,
        // Credentials, headers outside the fingerprint, or transient: may change.
        401 | 403 | 404 | 406 | 408 | 409 | 411 | 412 | 415 | 423 | 424 | 425 | 428 | 429 => false,
        400..=499 => true,
        _ => false,
    }
}

/// Builder of an [`IdempotencyLayer`]; see [`IdempotencyLayer::builder`] for the defaults.
#[must_use]
#[non_exhaustive]
pub struct IdempotencyBuilder {
    pool: PgPool,
    inbox: Inbox,
    header: String,
    replayed_header: String,
    max_key_len: usize,
    required: bool,
    max_request_bytes: usize,
    max_response_bytes: usize,
    stored_headers: Vec<HeaderName>,
    retention: Duration,
    scope: Option<Arc<ScopeFn>>,
    is_final: Arc<FinalFn>,
}

impl fmt::Debug for IdempotencyBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyBuilder")
            .field("inbox", &self.inbox.consumer())
            .field("header", &self.header)
            .field("replayed_header", &self.replayed_header)
            .field("max_key_len", &self.max_key_len)
            .field("required", &self.required)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("stored_headers", &self.stored_headers)
            .field("retention", &self.retention)
            .field("scoped", &self.scope.is_some())
            .finish_non_exhaustive()
    }
}

impl IdempotencyBuilder {
    /// Whether a request without the key is refused with 400 (default `true`, the draft's
    /// answer for an operation that requires it). When `false`, such a request runs the
    /// handler once per request, in a transaction the layer commits when the response is
    /// final and rolls back otherwise, exactly as for a keyed request minus the storing.
    pub fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }

    /// The longest key, in characters (default [`DEFAULT_MAX_KEY_LEN`], at most
    /// [`MAX_KEY_LEN`]). The 400 for a longer key says this number.
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.max_key_len = len;
        self
    }

    /// The request header carrying the key (default [`IDEMPOTENCY_KEY`]).
    pub fn header(mut self, name: impl Into<String>) -> Self {
        self.header = name.into();
        self
    }

    /// The response header that marks a replay (default [`IDEMPOTENT_REPLAYED`]).
    pub fn replayed_header(mut self, name: impl Into<String>) -> Self {
        self.replayed_header = name.into();
        self
    }

    /// The largest request body read for the fingerprint (default
    /// [`DEFAULT_MAX_REQUEST_BYTES`]); a larger one gets 413 and nothing runs.
    pub fn max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes;
        self
    }

    /// The largest response body stored (default [`DEFAULT_MAX_RESPONSE_BYTES`]). A final
    /// response with a larger body cannot be stored: the layer rolls back and answers 500, so
    /// size the limit to the route.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Also stores and replays this response header (besides `content-type`,
    /// `content-encoding`, `content-language` and `location`). `set-cookie` is refused by
    /// [`build`](Self::build): a replay must not hand out the first caller's session.
    pub fn store_header(mut self, name: HeaderName) -> Self {
        if !self.stored_headers.contains(&name) {
            self.stored_headers.push(name);
        }
        self
    }

    /// How long keys are remembered at least (default [`DEFAULT_RETENTION`]): what
    /// [`IdempotencyLayer::purge_expired`] purges past. At least one second.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The key space of a request, typically the authenticated principal (an account id):
    /// two requests share a key only if they have the same scope. It sees the request's
    /// head, extensions included (where an authentication layer in front leaves the
    /// principal). `None` (no principal) refuses a request that has a key with 401 before
    /// anything runs. Default: no scope, one key space for every client of the layer.
    pub fn scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.scope = Some(Arc::new(scope));
        self
    }

    /// Replaces the rule deciding whether a response without a [`Finality`] is final
    /// (default [`is_final_by_default`]). It is not asked about 5xx, which is never stored.
    pub fn is_final<F>(mut self, rule: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.is_final = Arc::new(rule);
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<IdempotencyLayer> {
        let invalid = |what: String| Err(Error::InvalidConfig(what));
        if !(1..=MAX_KEY_LEN).contains(&self.max_key_len) {
            return invalid(format!(
                "idempotency max_key_len {} must be between 1 and {MAX_KEY_LEN}",
                self.max_key_len
            ));
        }
        let header = header_name(&self.header, "header")?;
        let replayed_header = header_name(&self.replayed_header, "replayed_header")?;
        if self.stored_headers.contains(&header::SET_COOKIE) {
            return invalid("set-cookie cannot be a stored header: replays would share it".into());
        }
        if self.retention < Duration::from_secs(1) {
            return invalid(format!(
                "idempotency retention {:?} must be at least 1 s",
                self.retention
            ));
        }
        if self.max_request_bytes == 0 || self.max_response_bytes == 0 {
            return invalid("idempotency body limits must be greater than zero".into());
        }
        Ok(IdempotencyLayer {
            shared: Arc::new(Shared {
                pool: self.pool,
                inbox: self.inbox,
                header,
                header_display: self.header,
                replayed_header,
                max_key_len: self.max_key_len,
                required: self.required,
                max_request_bytes: self.max_request_bytes,
                max_response_bytes: self.max_response_bytes,
                stored_headers: self.stored_headers,
                retention: self.retention,
                scope: self.scope,
                is_final: self.is_final,
                ascii_only: OnceLock::new(),
            }),
        })
    }
}

fn header_name(name: &str, setting: &str) -> Result<HeaderName> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
        Error::InvalidConfig(format!(
            "idempotency {setting} {name:?} is not a header name"
        ))
    })
}

/// A tower [`Layer`] that makes a route idempotent by `Idempotency-Key`; see the
/// [module docs](self). Cheap to clone; put it on the routes it guards with
/// `route_layer` (axum's `MethodRouter::route_layer` or `Router::route_layer`).
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("inbox", &self.shared.inbox.consumer())
            .field("schema", &self.shared.inbox.schema())
            .field("header", &self.shared.header)
            .field("required", &self.shared.required)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer with the defaults of [`builder`](Self::builder).
    pub fn new(pool: PgPool, inbox: Inbox) -> Self {
        Self::builder(pool, inbox)
            .build()
            .expect("the default idempotency settings are valid")
    }

    /// A builder: transactions from `pool`, keys recorded in `inbox` (give it a consumer of
    /// its own; its [`Wait`](crate::Wait) decides what a concurrent same-key request does).
    /// Defaults: the key required in [`IDEMPOTENCY_KEY`], at most [`DEFAULT_MAX_KEY_LEN`]
    /// characters; replays marked with [`IDEMPOTENT_REPLAYED`]; bodies up to
    /// [`DEFAULT_MAX_REQUEST_BYTES`] in and [`DEFAULT_MAX_RESPONSE_BYTES`] stored; retention
    /// [`DEFAULT_RETENTION`]; no scope; [`is_final_by_default`].
    pub fn builder(pool: PgPool, inbox: Inbox) -> IdempotencyBuilder {
        IdempotencyBuilder {
            pool,
            inbox,
            header: IDEMPOTENCY_KEY.to_owned(),
            replayed_header: IDEMPOTENT_REPLAYED.to_owned(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            required: true,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            stored_headers: vec![
                header::CONTENT_TYPE,
                header::CONTENT_ENCODING,
                header::CONTENT_LANGUAGE,
                header::LOCATION,
            ],
            retention: DEFAULT_RETENTION,
            scope: None,
            is_final: Arc::new(is_final_by_default),
        }
    }

    /// The inbox the keys are recorded in.
    pub fn inbox(&self) -> &Inbox {
        &self.shared.inbox
    }

    /// The retention window of keys.
    pub fn retention(&self) -> Duration {
        self.shared.retention
    }

    /// Forgets the keys recorded more than the retention window ago (database clock): the
    /// inbox's [`purge_older_than`](Inbox::purge_older_than) for this layer's consumer.
    /// Returns the number of keys forgotten. Run it periodically, or let the
    /// [`Janitor`](crate::janitor::Janitor) do it with a `consumer_retention` for this
    /// layer's inbox consumer. Behind a pooler in transaction mode it needs the inbox built
    /// with [`Pooler::Transaction`], as the layer does.
    pub async fn purge_expired(&self) -> Result<u64> {
        self.shared
            .inbox
            .purge_older_than(&self.shared.pool, self.shared.retention)
            .await
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps a route in.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inbox", &self.shared.inbox.consumer())
            .finish_non_exhaustive()
    }
}

impl<S> Service<Request> for IdempotencyService<S>
where
    S: Service<Request, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = std::result::Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The service that was polled ready handles this request; a clone takes its place
        // for the next one (tower's pattern for services called from a boxed future).
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let shared = self.shared.clone();
        Box::pin(async move { Ok(shared.handle(inner, request).await) })
    }
}

/// The transaction the layer runs the handler in: extract it in the handler
/// (`tx: IdempotencyTx`) and [`lock`](Self::lock) it to run statements.
///
/// For a request with a key it is the transaction that claimed the key; the layer commits it
/// together with the stored response when the response is final, and rolls it back
/// otherwise. For a request without a key (on a layer where the key is not
/// [required](IdempotencyBuilder::required)), it begins on first use and is committed or
/// rolled back by the same rule. The handler cannot commit it through the guard (see
/// [`LayerConnection`]); nested units of work (`tx.begin()`) are savepoints and fine.
///
/// Extracting it on a route without the layer fails with 500.
#[derive(Clone)]
pub struct IdempotencyTx {
    slot: Arc<Mutex<Slot>>,
    key: Option<Arc<str>>,
}

struct Slot {
    tx: Option<LayerTransaction>,
    /// The inbox's pooler setting: how the handler's statements are sent.
    pooler: Pooler,
    /// For a request without a key: begin on first use, from this pool.
    begin_from: Option<PgPool>,
}

impl fmt::Debug for IdempotencyTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyTx")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl IdempotencyTx {
    /// The request's `Idempotency-Key` as the client sent it (without the scope), `None`
    /// for a request without one.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The transaction, for as long as the guard lives: run statements with
    /// `.execute(&mut **tx)` (a [`LayerConnection`], which refuses transaction control), pass
    /// `&mut tx.connection()` to pgbox's APIs that take a connection (such as
    /// [`Outbox::enqueue`](crate::Outbox::enqueue)). Drop the guard before the handler
    /// returns: the layer takes the transaction back then. Fails once the layer has ended the
    /// transaction (a task that outlived the handler), or if beginning it fails.
    pub async fn lock(&self) -> Result<TxGuard<'_>> {
        let mut slot = self.slot.lock().await;
        if slot.tx.is_none()
            && let Some(pool) = &slot.begin_from
        {
            // The pool stays until the layer closes the slot: a failed begin may be retried.
            let mut tx = crate::pooler::begin(pool, None).await?;
            let xact = transaction_id(&mut tx).await?;
            slot.tx = Some(LayerTransaction::new(tx, Some(xact), slot.pooler));
        }
        MutexGuard::try_map(slot, |slot| slot.tx.as_mut())
            .map(|guard| TxGuard { guard })
            .map_err(|_| {
                Error::InvalidConfig(
                    "the idempotency layer's transaction is over: use it only inside the handler"
                        .to_owned(),
                )
            })
    }

    fn new(
        tx: Option<Transaction<'static, Postgres>>,
        pool: Option<PgPool>,
        key: Option<&str>,
        pooler: Pooler,
    ) -> Self {
        IdempotencyTx {
            slot: Arc::new(Mutex::new(Slot {
                tx: tx.map(|tx| LayerTransaction::new(tx, None, pooler)),
                pooler,
                begin_from: pool,
            })),
            key: key.map(Arc::from),
        }
    }

    /// Takes the transaction back after the handler, and closes the slot to late users.
    async fn take(&self) -> Option<LayerConnection> {
        let mut slot = self.slot.lock().await;
        slot.begin_from = None;
        slot.tx.take().map(|tx| tx.conn)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyTx {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> std::result::Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyTx>()
            .cloned()
            .ok_or_else(|| {
                tracing::error!("IdempotencyTx extracted on a route without an IdempotencyLayer");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Idempotency layer missing",
                    "this route extracts IdempotencyTx but has no IdempotencyLayer in front of it"
                        .to_owned(),
                )
            })
    }
}

/// The layer's transaction, locked for the handler: `&mut **tx` (or `&mut *tx`) is an
/// executor on it that refuses to end it (see [`LayerConnection`]);
/// [`tx.connection()`](LayerConnection::connection) is the same for pgbox's own APIs
/// ([`Outbox::enqueue`](crate::Outbox::enqueue), [`StateTable`](crate::StateTable)).
pub struct TxGuard<'a> {
    guard: MappedMutexGuard<'a, LayerTransaction>,
}

impl fmt::Debug for TxGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxGuard").finish_non_exhaustive()
    }
}

impl Deref for TxGuard<'_> {
    type Target = LayerTransaction;

    fn deref(&self) -> &LayerTransaction {
        &self.guard
    }
}

impl DerefMut for TxGuard<'_> {
    fn deref_mut(&mut self) -> &mut LayerTransaction {
        &mut self.guard
    }
}

/// The layer's transaction as the handler holds it (`*tx` of a [`TxGuard`]): an executor like
/// the [`LayerConnection`] it derefs to, which is what `&mut **tx` gives. It is no
/// [`Transaction`]: the layer ends it, the handler cannot.
#[derive(Debug)]
pub struct LayerTransaction {
    conn: LayerConnection,
}

impl LayerTransaction {
    fn new(tx: Transaction<'static, Postgres>, xact: Option<String>, pooler: Pooler) -> Self {
        LayerTransaction {
            conn: LayerConnection {
                tx,
                unwatched: false,
                xact,
                pooler,
            },
        }
    }
}

impl Deref for LayerTransaction {
    type Target = LayerConnection;

    fn deref(&self) -> &LayerConnection {
        &self.conn
    }
}

impl DerefMut for LayerTransaction {
    fn deref_mut(&mut self) -> &mut LayerConnection {
        &mut self.conn
    }
}

/// The connection of the layer's transaction, as the handler runs statements on it:
/// `sqlx::query(…).execute(&mut **tx)`. It screens every statement as the inbox's
/// [`HandlerConnection`] does, so **nothing sent through it ends the layer's transaction**:
///
/// - every statement goes out with the extended protocol, one statement per message, so the
///   server refuses a text with a second statement (`SELECT 1; COMMIT`, SQLSTATE `42601`);
///   send a script's statements one call at a time;
/// - `BEGIN`, `START`, `COMMIT`, `END`, `ROLLBACK` (other than `ROLLBACK TO SAVEPOINT`),
///   `ABORT` and `PREPARE TRANSACTION` are refused with an error before they are sent (the
///   transaction stays usable). Nest a unit of work with `tx.begin()`: a savepoint.
///
/// **The raw connection is not screened**: `&mut ***tx` (a `&mut PgConnection`), or a nested
/// unit from `tx.begin()`, whose `Transaction` sits on it. The layer then checks, before it
/// stores or commits anything, that the connection is still in the transaction it began; if
/// not, it answers 500 and stores nothing, but what the handler did before ending the
/// transaction may have committed: never send transaction control there.
pub struct LayerConnection {
    tx: Transaction<'static, Postgres>,
    /// The raw connection was handed out: the transaction may have been ended unseen.
    unwatched: bool,
    /// For a request without a key: the transaction's id (`xid8` as text), taken when it
    /// began, for the check before COMMIT. (A keyed request's is its claim's.)
    xact: Option<String>,
    /// The inbox's pooler setting: behind a transaction pooler every statement goes unnamed.
    pooler: Pooler,
}

impl fmt::Debug for LayerConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerConnection")
            .field("unwatched", &self.unwatched)
            .finish_non_exhaustive()
    }
}

impl LayerConnection {
    /// The same screened connection as the inbox's handlers get, for pgbox's APIs that take
    /// one: `outbox.enqueue(&mut tx.connection(), message)`,
    /// `states.transition(&mut tx.connection(), id, to)`.
    pub fn connection(&mut self) -> HandlerConnection<'_> {
        HandlerConnection::new(&mut self.tx, self.pooler)
    }
}

impl Deref for LayerConnection {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for LayerConnection {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.unwatched = true;
        &mut self.tx
    }
}

/// Every call goes through a [`HandlerConnection`] made for it: its screening, one
/// implementation for the inbox and the layer.
impl<'c> Executor<'c> for &'c mut LayerConnection {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, std::result::Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let pooler = self.pooler;
        let conn: &'c mut PgConnection = &mut self.tx;
        // The screening connection lives in the stream's own future, which borrows it.
        TryAsyncStream::new(move |yielder| async move {
            let mut screened = HandlerConnection::new(conn, pooler);
            let mut results = (&mut screened).fetch_many(query);
            while let Some(result) = results.next().await {
                yielder.r#yield(result?).await;
            }
            Ok(())
        })
        .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, std::result::Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let pooler = self.pooler;
        let conn: &'c mut PgConnection = &mut self.tx;
        async move {
            let mut screened = HandlerConnection::new(conn, pooler);
            (&mut screened).fetch_optional(query).await
        }
        .boxed()
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, std::result::Result<PgStatement, sqlx::Error>>
    where
        'c: 'e,
    {
        let pooler = self.pooler;
        let conn: &'c mut PgConnection = &mut self.tx;
        async move {
            let mut screened = HandlerConnection::new(conn, pooler);
            (&mut screened).prepare_with(sql, parameters).await
        }
        .boxed()
    }

    fn describe<'e>(
        self,
        sql: SqlStr,
    ) -> BoxFuture<'e, std::result::Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        let pooler = self.pooler;
        let conn: &'c mut PgConnection = &mut self.tx;
        async move {
            let mut screened = HandlerConnection::new(conn, pooler);
            (&mut screened).describe(sql).await
        }
        .boxed()
    }
}

impl<'c> Executor<'c> for &'c mut LayerTransaction {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, std::result::Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        (&mut self.conn).fetch_many(query)
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, std::result::Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        (&mut self.conn).fetch_optional(query)
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, std::result::Result<PgStatement, sqlx::Error>>
    where
        'c: 'e,
    {
        (&mut self.conn).prepare_with(sql, parameters)
    }

    fn describe<'e>(
        self,
        sql: SqlStr,
    ) -> BoxFuture<'e, std::result::Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        (&mut self.conn).describe(sql)
    }
}

struct Shared {
    pool: PgPool,
    inbox: Inbox,
    header: HeaderName,
    /// The header's name as configured, for messages.
    header_display: String,
    replayed_header: HeaderName,
    max_key_len: usize,
    required: bool,
    max_request_bytes: usize,
    max_response_bytes: usize,
    stored_headers: Vec<HeaderName>,
    retention: Duration,
    scope: Option<Arc<ScopeFn>>,
    is_final: Arc<FinalFn>,
    /// Whether the database's encoding is not UTF-8, where what the layer writes must be
    /// ASCII (see [`Shared::ascii_only`]); learned on the first request with a key.
    ascii_only: OnceLock<bool>,
}

/// What a stored response is, in the inbox row's `outcome` column.
#[derive(Debug, Serialize, Deserialize)]
struct StoredResponse {
    /// [`STORED_FORMAT`].
    format: u32,
    /// SHA-256 (hex) of the request: a retry must be the same request.
    fingerprint: String,
    /// `METHOD /path` of the first request, for the 422 and for people reading the row.
    request: String,
    status: u16,
    /// The stored headers with UTF-8 values, in order.
    headers: Vec<(String, String)>,
    /// Every stored header, its value as hex, in order: written only when some value is not
    /// UTF-8, and then the one a replay uses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    headers_hex: Option<Vec<(String, String)>>,
    /// The body, when it is UTF-8 without NUL (jsonb's strings cannot hold NUL)...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body: Option<String>,
    /// ...else as hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body_hex: Option<String>,
}

/// Why a body could not be read whole.
enum Unread {
    TooLarge,
    Failed(axum::Error),
}

async fn read_body(body: Body, limit: usize) -> std::result::Result<Bytes, Unread> {
    if body.size_hint().lower() > limit as u64 {
        return Err(Unread::TooLarge);
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(Unread::Failed)?;
        if buf.len() + chunk.len() > limit {
            return Err(Unread::TooLarge);
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

impl Shared {
    async fn handle<S>(&self, inner: S, request: Request) -> Response
    where
        S: Service<Request, Error = Infallible> + Send,
        S::Response: IntoResponse,
        S::Future: Send,
    {
        let (parts, body) = request.into_parts();
        let key = match self.key(&parts.headers) {
            Ok(Some(key)) => key,
            Ok(None) if !self.required => {
                return self
                    .run_without_key(inner, Request::from_parts(parts, body))
                    .await;
            }
            Ok(None) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "Idempotency-Key missing",
                    format!(
                        "this operation requires an {} header: {}",
                        self.header_display,
                        self.key_rule()
                    ),
                );
            }
            Err(why) => return problem(StatusCode::BAD_REQUEST, "Invalid Idempotency-Key", why),
        };
        let scope = match &self.scope {
            Some(scope) => match scope(&parts) {
                Some(scope) => scope,
                None => {
                    return problem(
                        StatusCode::UNAUTHORIZED,
                        "Client unknown",
                        format!(
                            "{} keys are kept per client, and this request names none",
                            self.header_display
                        ),
                    );
                }
            },
            None => String::new(),
        };
        let body = match read_body(body, self.max_request_bytes).await {
            Ok(body) => body,
            Err(Unread::TooLarge) => {
                return problem(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "Request body too large",
                    format!(
                        "a request with an {} may have a body of at most {} bytes",
                        self.header_display, self.max_request_bytes
                    ),
                );
            }
            Err(Unread::Failed(e)) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "Request body unreadable",
                    format!("the request body could not be read: {e}"),
                );
            }
        };
        let target = client_target(&parts);
        let fingerprint = fingerprint(&parts.method, target, &body);
        let request_line = format!("{} {}", parts.method, target.path());
        let span = tracing::info_span!(
            "pgbox.idempotency",
            consumer = %self.inbox.consumer(),
            key = %key,
            request = %request_line,
        );
        let first = Request::from_parts(parts, Body::from(body));
        tracing::Instrument::instrument(
            self.run_with_key(inner, first, &key, &scope, fingerprint, request_line),
            span,
        )
        .await
    }

    /// The key from the headers: `Ok(None)` without one, `Err(what the 400 says)` for one
    /// that breaks the rule.
    fn key(&self, headers: &HeaderMap) -> std::result::Result<Option<String>, String> {
        let mut values = headers.get_all(&self.header).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        let broken = if values.next().is_some() {
            Some("it was sent more than once".to_owned())
        } else {
            key_fault(value.as_bytes(), self.max_key_len)
        };
        match broken {
            None => Ok(Some(
                // Visible ASCII only, checked above.
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )),
            Some(fault) => Err(format!("{}: {}", self.key_rule(), fault)),
        }
    }

    /// The rule a key must follow, as the 400 says it.
    fn key_rule(&self) -> String {
        format!(
            "{} must be 1 to {} visible ASCII characters (0x21 to 0x7E: letters, digits and \
             punctuation; no spaces or control characters)",
            self.header_display, self.max_key_len
        )
    }

    async fn run_with_key<S>(
        &self,
        inner: S,
        request: Request,
        key: &str,
        scope: &str,
        fingerprint: String,
        request_line: String,
    ) -> Response
    where
        S: Service<Request, Error = Infallible> + Send,
        S::Response: IntoResponse,
        S::Future: Send,
    {
        let mut attempt = 1;
        let (tx, claimed, ascii_only) = loop {
            let mut tx = match crate::pooler::begin(&self.pool, None).await {
                Ok(tx) => tx,
                Err(e) => return store_failed("begin", &e, true),
            };
            let ascii_only = match self.ascii_only(&mut tx).await {
                Ok(ascii_only) => ascii_only,
                Err(e) => {
                    rollback(tx).await;
                    return store_failed("begin", &e, true);
                }
            };
            match self
                .inbox
                .claim(&mut tx, inbox_key(scope, key, ascii_only).as_str())
                .await
            {
                Ok(Claim::Claimed(claimed)) => break (tx, claimed, ascii_only),
                Ok(Claim::Duplicate(duplicate)) => {
                    // Read only: nothing to keep.
                    rollback(tx).await;
                    return self.replay(&duplicate, &fingerprint);
                }
                Ok(Claim::InProgress) => {
                    rollback(tx).await;
                    return self.in_progress();
                }
                Err(e) if e.db_kind() == Some(DbErrorKind::LockTimeout) => {
                    // The session's own lock_timeout ran out behind the first request.
                    rollback(tx).await;
                    return self.in_progress();
                }
                Err(e) if e.db_kind() == Some(DbErrorKind::SerializationFailure) => {
                    // At REPEATABLE READ or SERIALIZABLE (the database's, the role's or the
                    // pool's default, kept for the handler), a claim that waited on another
                    // request's claim fails once that one commits: the row is newer than the
                    // claim's snapshot. Nothing ran yet; a new transaction sees the row and
                    // replays it (or claims, if it went away meanwhile).
                    rollback(tx).await;
                    if attempt < CLAIM_ATTEMPTS {
                        attempt += 1;
                        tracing::debug!(
                            attempt,
                            "claim met a concurrent commit of the key; claiming again"
                        );
                        continue;
                    }
                    // The key changed hands at every attempt: still busy, as far as we know.
                    return self.in_progress();
                }
                Err(e) => {
                    rollback(tx).await;
                    return store_failed("claim", &e, true);
                }
            }
        };
        let handle = IdempotencyTx::new(Some(tx), None, Some(key), self.inbox.pooler());
        let response = call(inner, with_tx(request, &handle)).await;
        let (mut parts, body) = response.into_parts();
        let is_final = self.is_final(parts.status, parts.extensions.remove::<Finality>());
        let Some(mut conn) = handle.take().await else {
            // Only the layer takes it.
            return store_failed(
                "handler",
                &Error::InvalidConfig("transaction gone".into()),
                true,
            );
        };
        // The handler took the raw connection, where transaction control is not screened:
        // before anything else runs on it, make sure it is still in the claim's transaction.
        if conn.unwatched
            && let Err(e) = self.inbox.verify_alive(&mut conn.tx, &claimed).await
        {
            rollback(conn.tx).await;
            return store_failed("handler", &ended_or_aborted(e), true);
        }
        let tx = conn.tx;
        if !is_final {
            rollback(tx).await;
            tracing::info!(
                status = parts.status.as_u16(),
                "response not final: not stored, effects rolled back"
            );
            return Response::from_parts(parts, body);
        }
        let body = match read_body(body, self.max_response_bytes).await {
            Ok(body) => body,
            Err(unread) => {
                rollback(tx).await;
                return match unread {
                    Unread::TooLarge => {
                        tracing::error!(
                            limit = self.max_response_bytes,
                            "response too large to store; rolled back"
                        );
                        problem(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "Response too large to store",
                            format!(
                                "the response is larger than the {} bytes an idempotent response \
                                 may have; nothing was done",
                                self.max_response_bytes
                            ),
                        )
                    }
                    Unread::Failed(e) => {
                        store_failed("response body", &Error::InvalidConfig(e.to_string()), true)
                    }
                };
            }
        };
        if let Some(e) = nested_unit_left_open(&tx) {
            rollback(tx).await;
            return store_failed("handler", &e, true);
        }
        let stored = self.stored(&parts, &body, fingerprint, request_line, ascii_only);
        match commit_stored(tx, claimed, &stored).await {
            Ok(()) => {
                tracing::debug!(
                    status = parts.status.as_u16(),
                    "response stored with the effects"
                );
                Response::from_parts(parts, Body::from(body))
            }
            Err(e) => store_failed("store", &e, true),
        }
    }

    /// A request without a key, on a layer where it is optional: the same transaction rule,
    /// without a claim or a stored response.
    async fn run_without_key<S>(&self, inner: S, request: Request) -> Response
    where
        S: Service<Request, Error = Infallible> + Send,
        S::Response: IntoResponse,
        S::Future: Send,
    {
        let handle = IdempotencyTx::new(None, Some(self.pool.clone()), None, self.inbox.pooler());
        let response = call(inner, with_tx(request, &handle)).await;
        let (mut parts, body) = response.into_parts();
        let is_final = self.is_final(parts.status, parts.extensions.remove::<Finality>());
        if let Some(mut conn) = handle.take().await {
            // Statements through the screened connection cannot end the transaction, but a
            // failed one aborts it (and COMMIT of an aborted transaction rolls back without
            // an error), and the raw connection is not screened: a final answer is given only
            // for the transaction the layer began, alive. A non-final one is checked when the
            // raw connection was used, so that a 5xx never hides a COMMIT.
            let checked = if is_final || conn.unwatched {
                match still_in_transaction(&mut conn).await {
                    Ok(()) if is_final => nested_unit_left_open(&conn.tx).map_or(Ok(()), Err),
                    checked => checked,
                }
            } else {
                Ok(())
            };
            let ended = match checked {
                Ok(()) if is_final => conn.tx.commit().await.map_err(Error::from),
                Ok(()) => {
                    rollback(conn.tx).await;
                    Ok(())
                }
                Err(e) => {
                    rollback(conn.tx).await;
                    Err(e)
                }
            };
            if let Err(e) = ended {
                return store_failed("commit", &e, false);
            }
        }
        Response::from_parts(parts, body)
    }

    /// Whether what the layer writes must be ASCII: the database's encoding is not UTF-8
    /// (LATIN1, SQL_ASCII, …), which may have no character for a UTF-8 one (SQLSTATE 22P05),
    /// so a response body or header value that is not ASCII is stored as hex, and a scope that
    /// is not ASCII is keyed by its SHA-256. Asked once per layer, in the claim's transaction
    /// (the simple protocol: safe behind a transaction pooler).
    async fn ascii_only(&self, tx: &mut PgConnection) -> Result<bool> {
        if let Some(&ascii_only) = self.ascii_only.get() {
            return Ok(ascii_only);
        }
        let row = sqlx::raw_sql("SELECT pg_catalog.current_setting('server_encoding')")
            .fetch_one(tx)
            .await?;
        let encoding: String = row.try_get(0)?;
        let ascii_only = !encoding.eq_ignore_ascii_case("UTF8");
        if ascii_only {
            tracing::info!(
                encoding,
                "database encoding is not UTF-8: idempotency records keep to ASCII (hex bodies)"
            );
        }
        Ok(*self.ascii_only.get_or_init(|| ascii_only))
    }

    fn is_final(&self, status: StatusCode, finality: Option<Finality>) -> bool {
        if status.is_server_error() || status.is_informational() {
            return false;
        }
        match finality {
            Some(Finality::Final) => true,
            Some(Finality::Retryable) => false,
            None => (self.is_final)(status),
        }
    }

    fn stored(
        &self,
        parts: &axum::http::response::Parts,
        body: &Bytes,
        fingerprint: String,
        request: String,
        ascii_only: bool,
    ) -> StoredResponse {
        let all: Vec<(&str, &[u8])> = self
            .stored_headers
            .iter()
            .flat_map(|name| {
                parts
                    .headers
                    .get_all(name)
                    .iter()
                    .map(move |value| (name.as_str(), value.as_bytes()))
            })
            .collect();
        let utf8 = |value: &[u8]| {
            std::str::from_utf8(value)
                .ok()
                .filter(|text| !ascii_only || text.is_ascii())
                .map(str::to_owned)
        };
        let headers = all
            .iter()
            .filter_map(|(name, value)| Some(((*name).to_owned(), utf8(value)?)))
            .collect::<Vec<_>>();
        // A value that is not UTF-8 (HTTP allows any byte but controls): every stored header
        // as hex, in order, so the replay has them byte for byte. `headers` keeps the UTF-8
        // ones for readers that predate `headers_hex`.
        let headers_hex = (headers.len() < all.len()).then(|| {
            all.iter()
                .map(|(name, value)| ((*name).to_owned(), to_hex(value)))
                .collect()
        });
        let text = std::str::from_utf8(body)
            .ok()
            .filter(|t| !t.contains('\0') && (!ascii_only || t.is_ascii()));
        // The request line is for people and the 422: its non-ASCII bytes, if any, escaped.
        let request = if ascii_only && !request.is_ascii() {
            request.escape_default().to_string()
        } else {
            request
        };
        StoredResponse {
            format: STORED_FORMAT,
            fingerprint,
            request,
            status: parts.status.as_u16(),
            headers,
            headers_hex,
            body: text.map(str::to_owned),
            body_hex: text.is_none().then(|| to_hex(body)),
        }
    }

    /// The answer to a request whose key is recorded: the stored response if it is the same
    /// request, 422 if not.
    fn replay(&self, duplicate: &Duplicate, fingerprint: &str) -> Response {
        let unreadable = |why: &str| {
            tracing::error!(
                why,
                "key recorded without a response this layer can replay: is the inbox consumer \
                 shared with something else than this layer?"
            );
            problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Idempotency record unreadable",
                "this key is recorded without a response this server can replay".to_owned(),
            )
        };
        let stored: StoredResponse = match duplicate.outcome() {
            Ok(Some(stored)) => stored,
            Ok(None) => return self.spent_without_response(),
            Err(_) => return unreadable("not a stored response"),
        };
        if stored.fingerprint != fingerprint {
            tracing::info!(first = %stored.request, "key reused for a different request: 422");
            let mut response = problem_body(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Idempotency-Key reused",
                format!(
                    "this {} was first used for a different request ({}); a key may be sent \
                     again only with the same method, path, query and body",
                    self.header_display, stored.request
                ),
            );
            response["original_request"] = stored.request.into();
            return problem_response(StatusCode::UNPROCESSABLE_ENTITY, response);
        }
        tracing::info!(status = stored.status, "replayed the stored response");
        let Ok(status) = StatusCode::from_u16(stored.status) else {
            return unreadable("stored status out of range");
        };
        let body = match (stored.body, stored.body_hex) {
            (Some(text), _) => Bytes::from(text),
            (None, Some(hex)) => match from_hex(&hex) {
                Some(bytes) => Bytes::from(bytes),
                None => return unreadable("stored body is not hex"),
            },
            (None, None) => Bytes::new(),
        };
        let stored_headers: Option<Vec<(HeaderName, HeaderValue)>> = match &stored.headers_hex {
            Some(hex) => hex
                .iter()
                .map(|(name, value)| header_pair(name, &from_hex(value)?))
                .collect(),
            None => stored
                .headers
                .iter()
                .map(|(name, value)| header_pair(name, value.as_bytes()))
                .collect(),
        };
        let Some(stored_headers) = stored_headers else {
            return unreadable("a stored header is not a header");
        };
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        for (name, value) in stored_headers {
            headers.append(name, value);
        }
        headers.insert(
            self.replayed_header.clone(),
            HeaderValue::from_static("true"),
        );
        response
    }

    /// A key whose record committed without a response: its request's effects may have
    /// committed with it (a handler that ended the layer's transaction on the raw connection),
    /// and running it again could do them twice. Neither a replay nor "retry".
    fn spent_without_response(&self) -> Response {
        tracing::error!(
            "key recorded without a response: a handler ended the layer's transaction, or the \
             inbox consumer is shared with something else than this layer"
        );
        problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Idempotency key used without a stored response",
            format!(
                "a request with this {} committed without a stored response (its handler ended \
                 the transaction); its outcome cannot be replayed and it will not run again: \
                 check whether it took effect before sending it with a new key",
                self.header_display
            ),
        )
    }

    fn in_progress(&self) -> Response {
        tracing::info!("key in flight in another request: 409");
        let mut response = problem(
            StatusCode::CONFLICT,
            "Request in progress",
            format!(
                "a request with this {} is still being processed; retry later",
                self.header_display
            ),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    }
}

/// Whatever is wrong with a key, `None` if nothing. The first fault found, in the order the
/// rule states them.
fn key_fault(key: &[u8], max_len: usize) -> Option<String> {
    if key.is_empty() {
        return Some("it is empty".to_owned());
    }
    if let Some(&b) = key.iter().find(|b| !(0x21..=0x7e).contains(*b)) {
        return Some(
            match b {
                b' ' => "it contains a space",
                b'\t' => "it contains a tab",
                0..=0x1f | 0x7f => "it contains a control character",
                _ => "it contains a non-ASCII byte",
            }
            .to_owned(),
        );
    }
    (key.len() > max_len).then(|| format!("it has {} characters", key.len()))
}

/// The inbox key of `key` in `scope`: the scope's length first, so no scope and key pair can
/// spell another pair's key; a long scope (or one with NUL, which text columns refuse, or,
/// when the database's encoding is not UTF-8 (`ascii_only`), one that is not ASCII, which it
/// may not hold) as its SHA-256 behind `#`, which no length starts with. At most 3 + 1 + 256
/// + 1 + 512 bytes, under the inbox's limit.
fn inbox_key(scope: &str, key: &str, ascii_only: bool) -> String {
    if scope.len() > MAX_SCOPE_BYTES || scope.contains('\0') || (ascii_only && !scope.is_ascii()) {
        format!("#{}:{key}", to_hex(&Sha256::digest(scope.as_bytes())))
    } else {
        format!("{}:{scope}:{key}", scope.len())
    }
}

/// SHA-256 of the method, the path with its query, and the body; each part's length is
/// hashed before it, so no two requests share the hashed bytes.
fn fingerprint(method: &Method, uri: &Uri, body: &[u8]) -> String {
    let target = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut hash = Sha256::new();
    for part in [method.as_str().as_bytes(), target.as_bytes(), body] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    to_hex(&hash.finalize())
}

fn with_tx(request: Request, handle: &IdempotencyTx) -> Request {
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(handle.clone());
    Request::from_parts(parts, body)
}

async fn call<S>(mut inner: S, request: Request) -> Response
where
    S: Service<Request, Error = Infallible>,
    S::Response: IntoResponse,
{
    match inner.call(request).await {
        Ok(response) => response.into_response(),
        Err(never) => match never {},
    }
}

/// Stores the response on the claim's row and commits: one transaction with the handler's
/// effects. The UPDATE names the claiming transaction, so it fails if the handler ended the
/// transaction or swallowed a failed statement, and then nothing commits.
async fn commit_stored(
    mut tx: Transaction<'static, Postgres>,
    claimed: Claimed,
    stored: &StoredResponse,
) -> Result<()> {
    if let Err(e) = claimed.store_outcome(&mut tx, stored).await {
        rollback(tx).await;
        return Err(match crate::inbox::handler_aborted(e) {
            // No row of this transaction's claim to store on: it is not the claim's any more.
            Error::NotClaimed { .. } => Error::TransactionEndedInHandler,
            e => e,
        });
    }
    tx.commit().await?;
    Ok(())
}

/// A check after the handler failed: [`Error::TransactionAbortedInHandler`] for an aborted
/// transaction, [`Error::TransactionEndedInHandler`] for none at all (SQLSTATE 25P01, e.g. the
/// `ROLLBACK TO SAVEPOINT` sqlx queued for a nested unit dropped after the transaction ended).
fn ended_or_aborted(e: Error) -> Error {
    let no_transaction = matches!(
        &e,
        Error::Database { source, .. }
            if source.as_database_error().and_then(|d| d.code()).as_deref() == Some("25P01")
    );
    if no_transaction {
        tracing::error!(error = %e, "the idempotency layer's transaction was ended inside the handler");
        return Error::TransactionEndedInHandler;
    }
    crate::inbox::handler_aborted(e)
}

/// Whether the handler left a nested unit of work (`tx.begin()`) neither committed nor rolled
/// back (`mem::forget`): then sqlx's `commit()` would only release its savepoint, answering Ok
/// with nothing committed, so the layer rolls back instead.
fn nested_unit_left_open(tx: &Transaction<'static, Postgres>) -> Option<Error> {
    (PgTransactionManager::get_transaction_depth(tx) > 1).then(|| {
        Error::InvalidConfig(
            "the handler left a nested unit of work (tx.begin()) neither committed nor rolled \
             back"
                .to_owned(),
        )
    })
}

/// The id of the transaction `tx` is in (`xid8` as text; assigning one if it had none). The
/// simple protocol, as for [`still_in_transaction`].
async fn transaction_id(tx: &mut PgConnection) -> Result<String> {
    let row = sqlx::raw_sql("SELECT pg_catalog.pg_current_xact_id()::text")
        .fetch_one(tx)
        .await?;
    Ok(row.try_get::<String, _>(0)?)
}

/// Whether a request without a key's transaction is alive and still the one the layer began:
/// [`Error::TransactionAbortedInHandler`] after a swallowed failure,
/// [`Error::TransactionEndedInHandler`] once the handler ended it. The simple protocol, with
/// the id written in: the statement runs outside any transaction when the handler ended it,
/// where a statement with parameters is unsafe behind a transaction pooler.
async fn still_in_transaction(conn: &mut LayerConnection) -> Result<()> {
    let Some(xact) = conn
        .xact
        .as_deref()
        .filter(|x| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit()))
    else {
        return Err(Error::InvalidConfig(
            "the layer's transaction has no id to check".to_owned(),
        ));
    };
    let same = sqlx::raw_sql(AssertSqlSafe(format!(
        "SELECT pg_catalog.pg_current_xact_id_if_assigned() = '{xact}'::xid8"
    )))
    .fetch_one(&mut *conn.tx)
    .await
    .map_err(|e| ended_or_aborted(e.into()))?;
    match same.try_get::<Option<bool>, _>(0)? {
        Some(true) => Ok(()),
        _ => {
            tracing::error!("the idempotency layer's transaction was ended inside the handler");
            Err(Error::TransactionEndedInHandler)
        }
    }
}

async fn rollback(mut tx: Transaction<'static, Postgres>) {
    // A nested unit the handler never ended (`mem::forget`) leaves sqlx's depth above 1, where
    // `rollback()` only rolls back to the unit's savepoint and the pool lends the connection
    // on inside the transaction: unwind the units first. Each step lowers the depth or fails.
    while PgTransactionManager::get_transaction_depth(&tx) > 1 {
        if let Err(e) = PgTransactionManager::rollback(&mut tx).await {
            // The transaction was ended under sqlx too (transaction control on the raw
            // connection): make sure the session is out of any, the rest is sqlx's.
            tracing::warn!(error = %e, "idempotency rollback of a leaked nested unit failed");
            let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await;
            break;
        }
    }
    if let Err(e) = tx.rollback().await {
        // The connection is gone with its transaction: nothing of it remains.
        tracing::warn!(error = %e, "idempotency rollback failed");
    }
}

/// A 500 for a failure of the layer's own work; logged, and nothing of it committed (except
/// when COMMIT itself failed in flight, which the next retry settles: a replay if it did).
/// Only a request that has a key (`keyed`) is told to retry with it.
fn store_failed(step: &str, e: &Error, keyed: bool) -> Response {
    tracing::error!(step, error = %e, "idempotency layer failed");
    if let Error::TransactionEndedInHandler = e {
        // Not "nothing happened": what ran before the end may have committed.
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Transaction ended by the handler",
            "the handler ended the request's transaction itself; nothing was recorded for \
             this request, but what it did before may have taken effect: check before sending \
             it again"
                .to_owned(),
        );
    }
    let detail = if keyed {
        format!("the request could not be completed ({step}); retry with the same key")
    } else {
        format!("the request could not be completed ({step})")
    };
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Idempotency store failed",
        detail,
    )
}

/// The target the client sent: axum's [`OriginalUri`] when a `Router` recorded it (a route
/// under `nest` sees its URI without the nest's prefix), else the request's URI.
fn client_target(parts: &Parts) -> &Uri {
    parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0)
}

fn header_pair(name: &str, value: &[u8]) -> Option<(HeaderName, HeaderValue)> {
    Some((
        HeaderName::from_bytes(name.as_bytes()).ok()?,
        HeaderValue::from_bytes(value).ok()?,
    ))
}

/// An RFC 9457 problem document.
fn problem(status: StatusCode, title: &str, detail: String) -> Response {
    problem_response(status, problem_body(status, title, detail))
}

fn problem_body(status: StatusCode, title: &str, detail: String) -> serde_json::Value {
    serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    })
}

fn problem_response(status: StatusCode, body: serde_json::Value) -> Response {
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        hex.push(DIGITS[usize::from(b >> 4)] as char);
        hex.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
    hex
}

fn from_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.is_ascii() || !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_rule_faults() {
        assert_eq!(key_fault(b"", 255).as_deref(), Some("it is empty"));
        assert_eq!(
            key_fault(b"a b", 255).as_deref(),
            Some("it contains a space")
        );
        assert_eq!(
            key_fault(b"a\tb", 255).as_deref(),
            Some("it contains a tab")
        );
        assert_eq!(
            key_fault("é".as_bytes(), 255).as_deref(),
            Some("it contains a non-ASCII byte")
        );
        assert_eq!(
            key_fault(b"a\x7fb", 255).as_deref(),
            Some("it contains a control character")
        );
        assert_eq!(key_fault(&[b'k'; 255], 255), None);
        assert_eq!(
            key_fault(&[b'k'; 256], 255).as_deref(),
            Some("it has 256 characters")
        );
        assert_eq!(key_fault(b"\"8e03978e\"", 255), None);
        assert_eq!(key_fault(b"!~", 255), None);
    }

    fn inbox_key_utf8(scope: &str, key: &str) -> String {
        inbox_key(scope, key, false)
    }

    #[test]
    fn inbox_keys_of_different_scopes_never_meet() {
        assert_ne!(inbox_key_utf8("a:1", "x"), inbox_key_utf8("a", "1:x"));
        assert_ne!(inbox_key_utf8("", "1:a:x"), inbox_key_utf8("a", "x"));
        assert_eq!(inbox_key_utf8("alice", "k"), "5:alice:k");
        let long = "s".repeat(MAX_SCOPE_BYTES + 1);
        let hashed = inbox_key_utf8(&long, &"k".repeat(MAX_KEY_LEN));
        assert!(hashed.starts_with('#'));
        assert!(hashed.len() <= crate::MAX_KEY_BYTES);
        let longest = inbox_key_utf8(&"s".repeat(MAX_SCOPE_BYTES), &"k".repeat(MAX_KEY_LEN));
        assert!(longest.len() <= crate::MAX_KEY_BYTES);
        assert_ne!(inbox_key_utf8("a\0b", "k"), inbox_key_utf8("a", "k"));
        // A database that is not UTF-8 gets only ASCII: a scope that is not ASCII is hashed
        // there (and only there: existing keys of UTF-8 databases keep their form).
        assert_eq!(inbox_key("\u{7528}", "k", false), "3:\u{7528}:k");
        let hashed = inbox_key("\u{7528}", "k", true);
        assert!(hashed.starts_with('#') && hashed.is_ascii(), "{hashed}");
        assert_eq!(inbox_key("alice", "k", true), "5:alice:k");
    }

    #[test]
    fn fingerprint_covers_method_path_query_and_body() {
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        let base = fingerprint(&Method::POST, &uri("/a?x=1"), b"{}");
        assert_eq!(base, fingerprint(&Method::POST, &uri("/a?x=1"), b"{}"));
        assert_ne!(base, fingerprint(&Method::PUT, &uri("/a?x=1"), b"{}"));
        assert_ne!(base, fingerprint(&Method::POST, &uri("/b?x=1"), b"{}"));
        assert_ne!(base, fingerprint(&Method::POST, &uri("/a?x=2"), b"{}"));
        assert_ne!(base, fingerprint(&Method::POST, &uri("/a?x=1"), b"{ }"));
        // The lengths keep the parts apart.
        assert_ne!(
            fingerprint(&Method::POST, &uri("/ab"), b"c"),
            fingerprint(&Method::POST, &uri("/a"), b"bc")
        );
        assert_eq!(base.len(), 64);
    }

    /// Over generated prefixes and targets: the fingerprint is of the original URI when axum
    /// recorded one (what a route under `nest` does not see), and two requests that differ
    /// only in their prefix, or in their query, never share it.
    #[test]
    fn fingerprints_use_the_original_uri_over_generated_prefixes() {
        use rand::Rng;
        const PIECES: &[&str] = &["a", "1", "%2F", "%20", "-", "~", "accounts", "x"];
        let mut rng = rand::rng();
        let mut piece = || {
            (0..rng.random_range(1..4))
                .map(|_| PIECES[rng.random_range(0..PIECES.len())])
                .collect::<String>()
        };
        let mut seen = std::collections::HashMap::new();
        for _ in 0..2_000 {
            let prefix = match piece().as_str() {
                "a" => String::new(),
                p => format!("/{p}"),
            };
            let rest = format!("/{}", piece());
            let query = ["", "?", "?q=1", "?q=%2F"][rand::rng().random_range(0..4)];
            let original: Uri = format!("{prefix}{rest}{query}").parse().unwrap();
            let (mut parts, ()) = Request::post(format!("{rest}{query}"))
                .body(())
                .unwrap()
                .into_parts();
            parts.extensions.insert(OriginalUri(original.clone()));
            assert_eq!(client_target(&parts), &original);
            let print = fingerprint(&parts.method, client_target(&parts), b"{}");
            let target = original.to_string();
            if let Some(other) = seen.insert(print, target.clone()) {
                assert_eq!(other, target, "two targets share a fingerprint");
            }
        }
        // Without axum's record (a plain tower stack), the request's own URI.
        let (parts, ()) = Request::post("/a?b").body(()).unwrap().into_parts();
        assert_eq!(client_target(&parts), "/a?b");
    }

    #[test]
    fn finality_by_status() {
        for ok in [200, 201, 204, 303, 400, 402, 405, 410, 413, 422] {
            assert!(
                is_final_by_default(StatusCode::from_u16(ok).unwrap()),
                "{ok}"
            );
        }
        for not in [
            100, 401, 403, 404, 406, 408, 409, 411, 412, 415, 423, 424, 425, 428, 429, 500, 502,
            503,
        ] {
            assert!(
                !is_final_by_default(StatusCode::from_u16(not).unwrap()),
                "{not}"
            );
        }
    }

    #[test]
    fn hex_round_trips() {
        let bytes = [0u8, 1, 0x7f, 0x80, 0xff];
        assert_eq!(to_hex(&bytes), "00017f80ff");
        assert_eq!(from_hex("00017f80ff").unwrap(), bytes);
        assert_eq!(from_hex("0"), None);
        assert_eq!(from_hex("zz"), None);
        assert_eq!(from_hex("éé"), None);
    }
}
