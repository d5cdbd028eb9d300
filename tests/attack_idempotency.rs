//! An attack on the `Idempotency-Key` layer (`pgbox::idempotency`, feature `axum`), after the
//! issue 34 changes (defects 7–10).
//!
//! # The promise attacked (README "An Idempotency-Key layer for HTTP APIs", module docs)
//!
//! 1. The response is stored if and only if the handler's effects committed: it is written to
//!    the claim's inbox row in the handler's transaction. A failed handler (5xx, a panic, a
//!    non-final 4xx) leaves nothing: its effects roll back, the key stays free, a retry runs.
//! 2. A retry (same key, method, path with query as sent, body) gets the stored status,
//!    stored headers (byte for byte, non-UTF-8 too) and body, with `Idempotent-Replayed:
//!    true`; the same key with another request is 422; never a replay of another request.
//! 3. A concurrent same-key request waits (`Wait::Block`), then replays; exactly one effect.
//!    Also at REPEATABLE READ / SERIALIZABLE database defaults.
//! 4. Keys: 1..=255 visible ASCII (0x21–0x7E), sent once, else 400; nothing stored.
//! 5. Request body over the limit: 413; response over the stored limit: 500, rolled back.
//! 6. Status rule: 2xx, 3xx, most 4xx stored; 401, 403, 404, 406, 408, 409, 411, 412, 415,
//!    423–425, 428, 429 and every 5xx not stored (a retry runs again).
//! 7. A request dropped mid-flight (client gone, outer timeout) commits nothing, leaves its
//!    key free, no pooled connection inside a transaction.
//! 8. The handler must not end the transaction; if it does "it gets a 500, never a stored
//!    response" — and the 500 tells a keyed client to retry with the same key.
//! 9. Stored responses survive a restart (read by another layer/pool).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request as AxRequest, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use pgbox::idempotency::{IdempotencyLayer, IdempotencyTx};
use pgbox::{Inbox, Wait};
use rand::Rng;
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::TestDb;
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;

const CONSUMER: &str = "attack";

const SCHEMA: &str = "CREATE TABLE charges (id bigserial PRIMARY KEY, key text NOT NULL, \
                      body_len int NOT NULL);";

/// What the test and the handler share.
struct Ctl {
    /// `x-gate: 1` requests wait here after writing...
    gate: Semaphore,
    /// ...and say so here first.
    entered: Notify,
    /// `x-fail-first: 1` answers 500 (after writing) while this is above zero.
    failures_left: AtomicU32,
}

type Shared = Arc<Ctl>;

fn failed(e: impl std::fmt::Display) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
}

fn hdr<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The one handler; what it does is chosen by headers, which are outside the fingerprint, so
/// a retry can behave differently from the first attempt:
/// - writes a charge (key, body length) on the layer's transaction;
/// - `x-sql`: then runs this text with `sqlx::raw_sql` on the same transaction;
/// - `x-sql-then-charge`: runs this text first, then writes the charge;
/// - `x-panic`: panics after writing;
/// - `x-hang`: notifies `entered` and never returns;
/// - `x-gate`: notifies `entered` and waits for a permit;
/// - `x-fail-first`: 500 while `failures_left` lasts;
/// - `x-status`: answers this status (default 201);
/// - `x-resp-bytes`: a body of that many bytes (with NUL and non-UTF-8), streamed in chunks.
async fn act(
    State(ctl): State<Shared>,
    tx: IdempotencyTx,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = tx.key().unwrap_or("<none>").to_owned();
    if let Some(sql) = hdr(&headers, "x-sql-then-charge") {
        let mut guard = match tx.lock().await {
            Ok(g) => g,
            Err(e) => return failed(e),
        };
        if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut **guard)
            .await
        {
            return failed(e);
        }
    }
    let id: i64 = {
        let mut guard = match tx.lock().await {
            Ok(g) => g,
            Err(e) => return failed(e),
        };
        match sqlx::query_scalar("INSERT INTO charges (key, body_len) VALUES ($1, $2) RETURNING id")
            .bind(&key)
            .bind(body.len() as i32)
            .fetch_one(&mut **guard)
            .await
        {
            Ok(id) => id,
            Err(e) => return failed(e),
        }
    };
    if let Some(sql) = hdr(&headers, "x-sql") {
        let mut guard = match tx.lock().await {
            Ok(g) => g,
            Err(e) => return failed(e),
        };
        if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut **guard)
            .await
        {
            return failed(e);
        }
    }
    if headers.contains_key("x-panic") {
        panic!("handler panics on purpose");
    }
    if headers.contains_key("x-hang") {
        ctl.entered.notify_one();
        std::future::pending::<()>().await;
    }
    if headers.contains_key("x-gate") {
        ctl.entered.notify_one();
        ctl.gate.acquire().await.expect("gate").forget();
    }
    if headers.contains_key("x-fail-first")
        && ctl
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    {
        return (StatusCode::INTERNAL_SERVER_ERROR, "injected failure").into_response();
    }
    let status = hdr(&headers, "x-status")
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    if let Some(n) = hdr(&headers, "x-resp-bytes").and_then(|s| s.parse::<usize>().ok()) {
        let bytes: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let chunks: Vec<Result<Bytes, std::io::Error>> = bytes
            .chunks(1000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let mut r = Response::new(Body::from_stream(futures_util::stream::iter(chunks)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        return r;
    }
    (
        status,
        [(header::LOCATION, format!("/charges/{id}"))],
        axum::Json(json!({ "id": id, "key": key, "status": status.as_u16() })),
    )
        .into_response()
}

fn ctl() -> Shared {
    Arc::new(Ctl {
        gate: Semaphore::new(0),
        entered: Notify::new(),
        failures_left: AtomicU32::new(0),
    })
}

fn router(layer: IdempotencyLayer, ctl: &Shared) -> Router {
    Router::new()
        .route("/charges", post(act).get(act).put(act))
        .route("/other", post(act))
        .route_layer(layer)
        .with_state(ctl.clone())
}

async fn database() -> TestDb {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(SCHEMA).execute(&db.pool).await.unwrap();
    db
}

async fn pool_of(db: &TestDb, n: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(n)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(db.options.clone())
        .await
        .unwrap()
}

fn inbox() -> Inbox {
    Inbox::new(CONSUMER).unwrap()
}

#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A request: `method uri`, the key (raw bytes) if any, extra headers, a body.
fn req(
    method: Method,
    uri: &str,
    key: Option<&[u8]>,
    extra: &[(&str, &str)],
    body: impl Into<Body>,
) -> Request<Body> {
    let mut b = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", HeaderValue::from_bytes(k).unwrap());
    }
    for (n, v) in extra {
        b = b.header(*n, *v);
    }
    b.body(body.into()).unwrap()
}

async fn send(router: &Router, request: Request<Body>) -> Answer {
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: axum::body::to_bytes(body, usize::MAX).await.unwrap(),
    }
}

async fn post_key(router: &Router, key: &str, extra: &[(&str, &str)], body: &str) -> Answer {
    send(
        router,
        req(
            Method::POST,
            "/charges",
            Some(key.as_bytes()),
            extra,
            body.to_owned(),
        ),
    )
    .await
}

async fn charges_of(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn all_charges(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The inbox row of `key` (no scope): (exists, has an outcome).
async fn key_row(pool: &PgPool, key: &str) -> (bool, bool) {
    let row: Option<(Option<Value>,)> =
        sqlx::query_as("SELECT outcome FROM pgbox.inbox WHERE consumer = $1 AND key = $2")
            .bind(CONSUMER)
            .bind(format!("0::{key}"))
            .fetch_optional(pool)
            .await
            .unwrap();
    match row {
        None => (false, false),
        Some((outcome,)) => (true, outcome.is_some()),
    }
}

async fn all_keys(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = $1")
        .bind(CONSUMER)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Every connection of `pool`, taken at once, is outside a transaction (the simple protocol:
/// the statement and its implicit transaction start together).
async fn no_pooled_connection_in_a_transaction(pool: &PgPool, size: u32) {
    let mut held = Vec::new();
    for _ in 0..size {
        let mut c = tokio::time::timeout(Duration::from_secs(60), pool.acquire())
            .await
            .expect("a pooled connection is stuck (60 s)")
            .unwrap();
        let row = sqlx::raw_sql("SELECT now() <> statement_timestamp()")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        assert!(
            !sqlx::Row::get::<bool, _>(&row, 0),
            "a pooled connection is inside a transaction"
        );
        held.push(c);
    }
}

// ---------------------------------------------------------------------------------------
// Findings (fixed): a handler that ends the layer's transaction through `&mut **tx`.
// ---------------------------------------------------------------------------------------

/// A handler given the layer's transaction sends `COMMIT` (alone or hidden in a
/// multi-statement text) and then answers 500. Promise: a failed handler leaves nothing, and
/// the response is replayed iff the effects committed. Was: the charge and the key's row
/// committed without a response, every retry 500 "unreadable". Now the statement is refused
/// (or the text, by the server, as more than one statement), nothing commits, the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_control_from_a_failing_handler_is_refused_and_the_retry_runs_once() {
    let db = database().await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(db.pool.clone(), inbox()), &ctl);
    let mut broken = Vec::new();
    for (i, sql) in [
        "COMMIT",
        "SELECT 1; COMMIT; SELECT 1",
        "end",
        "COMMIT AND CHAIN",
        "/* x */ COMMIT",
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("commit-fail-{i}");
        let first = post_key(&app, &key, &[("x-sql", sql), ("x-status", "500")], "{}").await;
        let retries: Vec<Answer> = {
            let mut v = Vec::new();
            for _ in 0..2 {
                v.push(post_key(&app, &key, &[], "{}").await);
            }
            v
        };
        let charges = charges_of(&db.pool, &key).await;
        let row = key_row(&db.pool, &key).await;
        // Either nothing of the failed run remains and the retry ran (1 charge, 201 not
        // replayed), or the retry replays what committed: never a committed effect behind a
        // key that answers 500 forever.
        let ok = retries.iter().all(|r| r.status == StatusCode::CREATED) && charges == 1;
        if !ok {
            broken.push(format!(
                "{sql:?}: first {} ; charges for the key {charges}; key row (exists, has \
                 response) {row:?}; retries: {:?}",
                first.status,
                retries
                    .iter()
                    .map(|r| format!("{} {}", r.status, r.text()))
                    .collect::<Vec<_>>()
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "a handler that ended the layer's transaction and failed:\n{}",
        broken.join("\n")
    );
}

/// The same with a handler that commits and then answers 201. Was: told 500 "retry with the
/// same key" into a key whose row committed without a response (500 forever). Now the
/// COMMIT is refused, the handler's error rolls back, and the retry is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_commit_is_refused_so_retry_with_the_same_key_is_answered() {
    let db = database().await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(db.pool.clone(), inbox()), &ctl);
    let first = post_key(&app, "commit-ok", &[("x-sql", "COMMIT")], "{}").await;
    let retry = post_key(&app, "commit-ok", &[], "{}").await;
    let charges = charges_of(&db.pool, "commit-ok").await;
    let row = key_row(&db.pool, "commit-ok").await;
    // Told to retry with the same key: the retry must then be answered (replay, or a run
    // whose effect is the only one).
    assert!(
        retry.status.is_success() && charges == 1,
        "first: {} {}; retry: {} {}; charges for the key: {charges}; key row (exists, has \
         response): {row:?}",
        first.status,
        first.text(),
        retry.status,
        retry.text()
    );
}

/// A handler that sends `ROLLBACK` on the layer's transaction, then writes. Was: the write
/// autocommitted, the key stayed free, the retry charged again (two effects for one key).
/// Now the ROLLBACK is refused: at most one charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_rollback_is_refused_so_a_write_after_it_never_autocommits() {
    let db = database().await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(db.pool.clone(), inbox()), &ctl);
    let first = post_key(&app, "rb", &[("x-sql-then-charge", "ROLLBACK")], "{}").await;
    let retry = post_key(&app, "rb", &[], "{}").await;
    let charges = charges_of(&db.pool, "rb").await;
    assert!(
        charges <= 1,
        "one key, {charges} charges; first: {} {}; retry: {} {} (replayed: {})",
        first.status,
        first.text(),
        retry.status,
        retry.text(),
        retry.replayed()
    );
}

// ---------------------------------------------------------------------------------------
// Attacks that held (kept as regression tests).
// ---------------------------------------------------------------------------------------

/// Hostile keys: empty, 256 characters, control characters, non-ASCII bytes, whitespace,
/// DEL, sent twice: 400 naming the rule, nothing run, nothing stored. The limits exactly: 1
/// and 255 characters, `!` and `~`, quotes, backslash, `%`/`_` run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_keys_are_refused_and_edge_keys_run() {
    let db = database().await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(db.pool.clone(), inbox()), &ctl);
    let long = vec![b'k'; 256];
    let refused: Vec<(&str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("256", long),
        ("space", b"a b".to_vec()),
        ("leading tab", b"\tab".to_vec()),
        ("tab", b"a\tb".to_vec()),
        ("latin-1", b"caf\xe9".to_vec()),
        ("utf-8", "caf\u{e9}".as_bytes().to_vec()),
        // (DEL and other control characters cannot be built into a header value at all.)
    ];
    for (what, key) in &refused {
        let r = send(&app, req(Method::POST, "/charges", Some(key), &[], "{}")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{what}: {}", r.text());
        assert!(r.text().contains("visible ASCII"), "{what}: {}", r.text());
    }
    // Sent twice.
    let twice = Request::post("/charges")
        .header("idempotency-key", "a")
        .header("Idempotency-Key", "a")
        .body(Body::from("{}"))
        .unwrap();
    let r = send(&app, twice).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    // Missing.
    let r = send(&app, req(Method::POST, "/charges", None, &[], "{}")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert_eq!(
        (all_charges(&db.pool).await, all_keys(&db.pool).await),
        (0, 0)
    );

    let k255 = "k".repeat(255);
    let accepted = [
        "x",
        &k255,
        "!",
        "~",
        "\"8e03978e\"",
        "a\\b",
        "%_%",
        "0::x",
        "';DROP/**/TABLE/**/charges;--",
    ];
    for key in accepted {
        let a = post_key(&app, key, &[], "{}").await;
        assert_eq!(
            (a.status, a.replayed()),
            (StatusCode::CREATED, false),
            "{key}: {}",
            a.text()
        );
        let b = post_key(&app, key, &[], "{}").await;
        assert_eq!(
            (b.status, b.replayed()),
            (StatusCode::CREATED, true),
            "{key}: {}",
            b.text()
        );
        assert_eq!(a.body, b.body, "{key}");
    }
    // Header name case does not matter.
    let upper = Request::post("/charges")
        .header("IDEMPOTENCY-KEY", "x")
        .body(Body::from("{}"))
        .unwrap();
    assert!(send(&app, upper).await.replayed());
    assert_eq!(all_charges(&db.pool).await, accepted.len() as i64);
}

/// The same key with another body, method, query order, path: 422 naming the first request;
/// the original still replays; one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_request_is_422_and_the_original_still_replays() {
    let db = database().await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(db.pool.clone(), inbox()), &ctl);
    let uri = "/charges?a=1&b=2";
    let first = send(&app, req(Method::POST, uri, Some(b"k"), &[], r#"{"x":1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let others = [
        req(Method::POST, uri, Some(b"k"), &[], r#"{"x":2}"#),
        req(Method::POST, uri, Some(b"k"), &[], r#"{"x": 1}"#),
        req(Method::POST, uri, Some(b"k"), &[], ""),
        req(Method::PUT, uri, Some(b"k"), &[], r#"{"x":1}"#),
        req(
            Method::POST,
            "/charges?b=2&a=1",
            Some(b"k"),
            &[],
            r#"{"x":1}"#,
        ),
        req(
            Method::POST,
            "/charges?a=1&b=2&",
            Some(b"k"),
            &[],
            r#"{"x":1}"#,
        ),
        req(Method::POST, "/charges", Some(b"k"), &[], r#"{"x":1}"#),
        req(
            Method::POST,
            "/other?a=1&b=2",
            Some(b"k"),
            &[],
            r#"{"x":1}"#,
        ),
    ];
    for other in others {
        let what = format!("{} {}", other.method(), other.uri());
        let r = send(&app, other).await;
        assert_eq!(
            r.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{what}: {}",
            r.text()
        );
        assert!(!r.replayed());
        assert!(r.text().contains("POST /charges"), "{}", r.text());
    }
    let again = send(&app, req(Method::POST, uri, Some(b"k"), &[], r#"{"x":1}"#)).await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CREATED, true)
    );
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers.get("location"), first.headers.get("location"));
    assert_eq!(all_charges(&db.pool).await, 1);
}

/// Ten requests with one key at once, the first held inside its handler: one effect; every
/// answer is the same 201, nine of them replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_same_key_requests_have_one_effect_and_one_answer() {
    let db = database().await;
    let pool = pool_of(&db, 12).await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(pool.clone(), inbox()), &ctl);
    let first = tokio::spawn({
        let app = app.clone();
        async move { post_key(&app, "ten", &[("x-gate", "1")], "{}").await }
    });
    ctl.entered.notified().await;
    let mut others = Vec::new();
    for _ in 0..9 {
        let app = app.clone();
        others.push(tokio::spawn(async move {
            post_key(&app, "ten", &[("x-gate", "1")], "{}").await
        }));
    }
    until_lock_waiters(&db.pool, 9).await;
    ctl.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    for o in others {
        let o = o.await.unwrap();
        assert_eq!(
            (o.status, o.replayed()),
            (StatusCode::CREATED, true),
            "{}",
            o.text()
        );
        assert_eq!(o.body, first.body);
    }
    assert_eq!(charges_of(&db.pool, "ten").await, 1);
}

async fn until_lock_waiters(pool: &PgPool, n: i64) {
    for _ in 0..3000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("fewer than {n} backends waiting on a lock after 30 s");
}

/// Ten requests with one key at once, half with another body, the first attempt failing
/// with 500: exactly one effect; every answer is either that effect's response or 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_mixed_requests_with_one_key_have_one_consistent_outcome() {
    for round in 0..3 {
        let db = database().await;
        let pool = pool_of(&db, 12).await;
        let ctl = ctl();
        ctl.failures_left.store(1, Ordering::SeqCst);
        let app = router(IdempotencyLayer::new(pool.clone(), inbox()), &ctl);
        let mut tasks = Vec::new();
        for i in 0..10 {
            let app = app.clone();
            let body = if i % 2 == 0 { "{\"a\":1}" } else { "{\"b\":2}" };
            tasks.push(tokio::spawn(async move {
                (
                    body,
                    post_key(&app, "mixed", &[("x-fail-first", "1")], body).await,
                )
            }));
        }
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.unwrap());
        }
        let winner: Vec<&(&str, Answer)> = answers
            .iter()
            .filter(|(_, a)| a.status == StatusCode::CREATED && !a.replayed())
            .collect();
        assert_eq!(winner.len(), 1, "round {round}: {answers:#?}");
        let (wbody, wanswer) = winner[0];
        for (body, a) in &answers {
            match a.status {
                StatusCode::CREATED => {
                    assert_eq!(body, wbody, "round {round}");
                    assert_eq!(a.body, wanswer.body, "round {round}");
                }
                StatusCode::UNPROCESSABLE_ENTITY => assert_ne!(body, wbody, "round {round}"),
                StatusCode::INTERNAL_SERVER_ERROR => {
                    assert_eq!(a.text(), "injected failure", "round {round}")
                }
                s => panic!("round {round}: unexpected {s}: {}", a.text()),
            }
        }
        assert_eq!(charges_of(&db.pool, "mixed").await, 1, "round {round}");
    }
}

/// The client hangs up at a random point of the request (the future dropped): every time,
/// no pooled connection is left in a transaction, and a retry with the same key either
/// replays what committed or runs; one effect per key in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_at_random_points_leaves_a_usable_key_and_one_effect() {
    let db = database().await;
    let size = 2;
    let pool = pool_of(&db, size).await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(pool.clone(), inbox()), &ctl);
    let mut rng = rand::rng();
    let mut dropped_before_answer = 0;
    for i in 0..60 {
        let key = format!("drop-{i}");
        let task = tokio::spawn({
            let (app, key) = (app.clone(), key.clone());
            async move { post_key(&app, &key, &[], "{}").await }
        });
        let micros = rng.random_range(0..4000);
        tokio::time::sleep(Duration::from_micros(micros)).await;
        task.abort();
        if task.await.is_err() {
            dropped_before_answer += 1;
        }
        let retry = tokio::time::timeout(Duration::from_secs(60), post_key(&app, &key, &[], "{}"))
            .await
            .unwrap_or_else(|_| panic!("{key}: the retry hangs (60 s)"));
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {}", retry.text());
        assert_eq!(charges_of(&db.pool, &key).await, 1, "{key}");
    }
    no_pooled_connection_in_a_transaction(&pool, size).await;
    eprintln!("{dropped_before_answer}/60 dropped before their answer");
}

/// A same-key request dropped while it waits behind the first one's claim, and the first
/// one then fails (500): the key stays free; the next retry runs (not blocked, not 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_dropped_leaves_the_key_free_when_the_first_fails() {
    let db = database().await;
    let size = 3;
    let pool = pool_of(&db, size).await;
    let ctl = ctl();
    ctl.failures_left.store(1, Ordering::SeqCst);
    let app = router(IdempotencyLayer::new(pool.clone(), inbox()), &ctl);
    let first = tokio::spawn({
        let app = app.clone();
        async move { post_key(&app, "w", &[("x-gate", "1"), ("x-fail-first", "1")], "{}").await }
    });
    ctl.entered.notified().await;
    let waiter = tokio::spawn({
        let app = app.clone();
        async move { post_key(&app, "w", &[], "{}").await }
    });
    until_lock_waiters(&db.pool, 1).await;
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    ctl.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retry = tokio::time::timeout(Duration::from_secs(60), post_key(&app, "w", &[], "{}"))
        .await
        .expect("the retry hangs (60 s)");
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, false),
        "{}",
        retry.text()
    );
    assert_eq!(charges_of(&db.pool, "w").await, 1);
    no_pooled_connection_in_a_transaction(&pool, size).await;
}

/// A handler that panics (the request task dies): nothing committed, the key free, the pool
/// clean, the retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_leaves_nothing() {
    let db = database().await;
    let pool = pool_of(&db, 1).await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(pool.clone(), inbox()), &ctl);
    let task = tokio::spawn({
        let app = app.clone();
        async move { post_key(&app, "p", &[("x-panic", "1")], "{}").await }
    });
    assert!(task.await.unwrap_err().is_panic());
    no_pooled_connection_in_a_transaction(&pool, 1).await;
    assert_eq!(
        (all_charges(&db.pool).await, all_keys(&db.pool).await),
        (0, 0)
    );
    let retry = post_key(&app, "p", &[], "{}").await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(charges_of(&db.pool, "p").await, 1);
}

/// The status rule, for each status the table names: stored (retry replays, one effect) or
/// not (effects rolled back, retry runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_status_is_stored_or_rolled_back_as_documented() {
    let db = database().await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(db.pool.clone(), inbox()), &ctl);
    let not_stored = [
        401, 403, 404, 406, 408, 409, 411, 412, 415, 423, 424, 425, 428, 429, 500, 501, 502, 503,
        504, 599,
    ];
    let stored = [
        200, 201, 202, 204, 301, 303, 307, 400, 402, 405, 410, 413, 418, 422, 426, 451,
    ];
    for s in stored.iter().chain(not_stored.iter()) {
        let key = format!("status-{s}");
        let status = s.to_string();
        let first = post_key(&app, &key, &[("x-status", &status)], "{}").await;
        assert_eq!(first.status.as_u16(), *s);
        let after_first = charges_of(&db.pool, &key).await;
        let retry = post_key(&app, &key, &[("x-status", "201")], "{}").await;
        if stored.contains(s) {
            assert_eq!(after_first, 1, "{s}");
            assert!(retry.replayed(), "{s}");
            assert_eq!(retry.status.as_u16(), *s);
            assert_eq!(retry.body, first.body, "{s}");
            assert_eq!(charges_of(&db.pool, &key).await, 1, "{s}");
        } else {
            assert_eq!(
                after_first, 0,
                "{s}: effects of a non-final answer rolled back"
            );
            assert_eq!(
                (retry.status, retry.replayed()),
                (StatusCode::CREATED, false),
                "{s}"
            );
            assert_eq!(charges_of(&db.pool, &key).await, 1, "{s}");
        }
    }
}

/// Bodies at and around the limits: a request body of exactly the limit runs, one byte
/// more (with or without a size hint) is 413; a streamed response of exactly the stored
/// limit (bytes that are not UTF-8, with NUL) is replayed byte for byte, across a restart;
/// one byte more is 500 and rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_at_the_limits_and_binary_streamed_responses() {
    let db = database().await;
    let ctl = ctl();
    let layer = || {
        IdempotencyLayer::builder(db.pool.clone(), inbox())
            .max_request_bytes(4096)
            .max_response_bytes(64 * 1024)
            .build()
            .unwrap()
    };
    let app = router(layer(), &ctl);
    let exact = "x".repeat(4096);
    let r = post_key(&app, "req-exact", &[], &exact).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    let over = "x".repeat(4097);
    let r = post_key(&app, "req-over", &[], &over).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    // A streamed request body (no exact size hint), over the limit in its last chunk.
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        (0..5).map(|_| Ok(Bytes::from(vec![b'y'; 1000]))).collect();
    let streamed = req(
        Method::POST,
        "/charges",
        Some(b"req-stream"),
        &[],
        Body::from_stream(futures_util::stream::iter(chunks)),
    );
    let r = send(&app, streamed).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(charges_of(&db.pool, "req-over").await, 0);
    assert_eq!(charges_of(&db.pool, "req-stream").await, 0);

    let n = (64 * 1024).to_string();
    let first = post_key(&app, "resp-exact", &[("x-resp-bytes", &n)], "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 64 * 1024);
    let expected: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    assert_eq!(first.body.as_ref(), expected.as_slice());
    // Another layer on another pool: a restart.
    let pool = pool_of(&db, 2).await;
    let app2 = router(
        IdempotencyLayer::builder(pool, inbox())
            .max_response_bytes(64 * 1024)
            .build()
            .unwrap(),
        &ctl,
    );
    let again = post_key(&app2, "resp-exact", &[], "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body.as_ref(), expected.as_slice());
    assert_eq!(
        again.headers.get("content-type").unwrap(),
        "application/octet-stream"
    );
    let n1 = (64 * 1024 + 1).to_string();
    let r = post_key(&app, "resp-over", &[("x-resp-bytes", &n1)], "{}").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(charges_of(&db.pool, "resp-over").await, 0);
    assert_eq!(key_row(&db.pool, "resp-over").await, (false, false));
    // A large non-final (5xx) streamed response goes through unbuffered, rolled back.
    let big = (4 * 1024 * 1024).to_string();
    let r = post_key(
        &app,
        "resp-5xx",
        &[("x-resp-bytes", &big), ("x-status", "503")],
        "{}",
    )
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.body.len(), 4 * 1024 * 1024);
    assert_eq!(charges_of(&db.pool, "resp-5xx").await, 0);
}

/// A timeout layer (a middleware that answers 408 when the handler takes too long) inside
/// the idempotency layer, and one outside it; a body-rewriting layer (like compression)
/// inside and outside. Inside: a timed-out handler's effects roll back and its key stays
/// free; the rewritten body is what is stored and replayed. Outside: the dropped request
/// leaves nothing; replays are rewritten like first answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_composes_with_timeout_and_body_rewriting_layers_in_both_orders() {
    async fn timeout_408(request: AxRequest, next: Next) -> Response {
        let hang = request.headers().contains_key("x-hang");
        match tokio::time::timeout(
            Duration::from_millis(if hang { 200 } else { 30_000 }),
            next.run(request),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => StatusCode::REQUEST_TIMEOUT.into_response(),
        }
    }
    async fn rewrite(request: AxRequest, next: Next) -> Response {
        let response = next.run(request).await;
        let (mut parts, body) = response.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let mut out = b"<<".to_vec();
        out.extend(bytes.iter().rev());
        parts.headers.remove(header::CONTENT_LENGTH);
        parts.headers.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static("reversed"),
        );
        Response::from_parts(parts, Body::from(out))
    }
    let db = database().await;
    let pool = pool_of(&db, 2).await;
    let ctl = ctl();
    let layer = IdempotencyLayer::new(pool.clone(), inbox());
    let base = || {
        Router::new()
            .route("/charges", post(act))
            .with_state(ctl.clone())
    };
    // Timeout inside (run before the idempotency layer's rollback decision).
    let inner_timeout = base()
        .route_layer(middleware::from_fn(timeout_408))
        .route_layer(layer.clone());
    let r = post_key(&inner_timeout, "t-in", &[("x-hang", "1")], "{}").await;
    assert_eq!(r.status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(charges_of(&db.pool, "t-in").await, 0);
    let r = post_key(&inner_timeout, "t-in", &[], "{}").await;
    assert_eq!(
        (r.status, r.replayed()),
        (StatusCode::CREATED, false),
        "{}",
        r.text()
    );
    // Timeout outside: the layer's future is dropped.
    let outer_timeout = base()
        .route_layer(layer.clone())
        .layer(middleware::from_fn(timeout_408));
    let r = post_key(&outer_timeout, "t-out", &[("x-hang", "1")], "{}").await;
    assert_eq!(r.status, StatusCode::REQUEST_TIMEOUT);
    let r = post_key(&outer_timeout, "t-out", &[], "{}").await;
    assert_eq!(
        (r.status, r.replayed()),
        (StatusCode::CREATED, false),
        "{}",
        r.text()
    );
    assert_eq!(charges_of(&db.pool, "t-out").await, 1);
    no_pooled_connection_in_a_transaction(&pool, 2).await;

    // A body-rewriting layer inside: stored rewritten, replayed as stored.
    let inner_rw = base()
        .route_layer(middleware::from_fn(rewrite))
        .route_layer(layer.clone());
    let a = post_key(&inner_rw, "rw-in", &[], "{}").await;
    let b = post_key(&inner_rw, "rw-in", &[], "{}").await;
    assert!(b.replayed());
    assert_eq!(a.body, b.body);
    assert!(a.body.starts_with(b"<<"));
    assert_eq!(b.headers.get("content-encoding").unwrap(), "reversed");
    // Outside: every answer rewritten once.
    let outer_rw = base()
        .route_layer(layer.clone())
        .layer(middleware::from_fn(rewrite));
    let a = post_key(&outer_rw, "rw-out", &[], "{}").await;
    let b = post_key(&outer_rw, "rw-out", &[], "{}").await;
    assert!(b.replayed());
    assert_eq!(a.body, b.body);
    assert!(a.body.starts_with(b"<<") && !a.body[2..].starts_with(b"<<"));
    assert_eq!(charges_of(&db.pool, "rw-in").await, 1);
    assert_eq!(charges_of(&db.pool, "rw-out").await, 1);
}

/// At REPEATABLE READ and SERIALIZABLE database defaults, ten same-key requests at once
/// whose first two runs fail (500): the rest wait and then replay the one committed answer
/// (never 409 under `Wait::Block`, never 500 other than the injected ones); one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_strict_isolation_ten_same_key_requests_with_failing_first_runs_settle_on_one() {
    for level in ["repeatable read", "serializable"] {
        let db = database().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{level}'",
            db.name
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let pool = pool_of(&db, 12).await;
        let ctl = ctl();
        ctl.failures_left.store(2, Ordering::SeqCst);
        let app = router(IdempotencyLayer::new(pool.clone(), inbox()), &ctl);
        let first = tokio::spawn({
            let app = app.clone();
            async move { post_key(&app, "iso", &[("x-gate", "1"), ("x-fail-first", "1")], "{}").await }
        });
        ctl.entered.notified().await;
        let mut others = Vec::new();
        for _ in 0..9 {
            let app = app.clone();
            others.push(tokio::spawn(async move {
                post_key(&app, "iso", &[("x-gate", "1"), ("x-fail-first", "1")], "{}").await
            }));
        }
        until_lock_waiters(&db.pool, 9).await;
        ctl.gate.add_permits(100);
        let mut answers = vec![first.await.unwrap()];
        for o in others {
            answers.push(o.await.unwrap());
        }
        let failures = answers
            .iter()
            .filter(|a| a.status == StatusCode::INTERNAL_SERVER_ERROR)
            .count();
        let created: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .collect();
        assert_eq!(failures, 2, "{level}: {answers:#?}");
        assert_eq!(created.len(), 8, "{level}: {answers:#?}");
        assert_eq!(
            created.iter().filter(|a| !a.replayed()).count(),
            1,
            "{level}"
        );
        assert!(created.iter().all(|a| a.body == created[0].body), "{level}");
        assert_eq!(charges_of(&db.pool, "iso").await, 1, "{level}");
    }
}

/// GET and HEAD: a GET with a key is stored and replayed; HEAD is another method (422), and
/// its answer carries no body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_and_head_with_a_key() {
    let db = database().await;
    let ctl = ctl();
    let app = router(IdempotencyLayer::new(db.pool.clone(), inbox()), &ctl);
    let a = send(&app, req(Method::GET, "/charges", Some(b"g"), &[], "")).await;
    let b = send(&app, req(Method::GET, "/charges", Some(b"g"), &[], "")).await;
    assert_eq!((a.status, b.replayed()), (StatusCode::CREATED, true));
    assert_eq!(a.body, b.body);
    let h = send(&app, req(Method::HEAD, "/charges", Some(b"g"), &[], "")).await;
    assert_eq!(h.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(h.body.is_empty());
    let h1 = send(&app, req(Method::HEAD, "/charges", Some(b"h"), &[], "")).await;
    let h2 = send(&app, req(Method::HEAD, "/charges", Some(b"h"), &[], "")).await;
    assert_eq!(
        (h1.status, h2.status, h2.replayed()),
        (StatusCode::CREATED, StatusCode::CREATED, true)
    );
    assert!(h1.body.is_empty() && h2.body.is_empty());
    assert_eq!(all_charges(&db.pool).await, 2);
}

/// A configured header name with capitals, and a replayed-header name: both work; a stored
/// header chosen by the application comes back; `set-cookie` is never replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_header_names_and_stored_headers() {
    let db = database().await;
    let layer = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .header("X-Request-Key")
        .replayed_header("X-Replayed")
        .store_header(HeaderName::from_static("x-first-run"))
        .build()
        .unwrap();
    async fn cookie(tx: IdempotencyTx) -> Response {
        let mut g = tx.lock().await.unwrap();
        sqlx::query("INSERT INTO charges (key, body_len) VALUES ('c', 0)")
            .execute(&mut **g)
            .await
            .unwrap();
        (
            StatusCode::OK,
            [
                (header::SET_COOKIE, "session=first"),
                (HeaderName::from_static("x-first-run"), "yes"),
            ],
            "ok",
        )
            .into_response()
    }
    let app = Router::new().route("/c", post(cookie)).route_layer(layer);
    let r = |k: &str| {
        Request::post("/c")
            .header("x-request-key", k.to_owned())
            .body(Body::empty())
            .unwrap()
    };
    let a = send(&app, r("k")).await;
    let b = send(&app, r("k")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(b.headers.get("x-replayed").unwrap(), "true");
    assert!(b.headers.get("set-cookie").is_none());
    assert_eq!(b.headers.get("x-first-run").unwrap(), "yes");
    assert_eq!(all_charges(&db.pool).await, 1);
    // The default header name is not this layer's.
    let c = send(
        &app,
        Request::post("/c")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(c.status, StatusCode::BAD_REQUEST);
    assert!(c.text().contains("X-Request-Key"), "{}", c.text());
}

/// `Wait::NoWait`: a same-key request while the first is in flight is 409 with
/// `Retry-After: 1` and leaves nothing; afterwards it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wait_in_flight_is_409_then_replays() {
    let db = database().await;
    let pool = pool_of(&db, 4).await;
    let ctl = ctl();
    let inbox = Inbox::builder(CONSUMER).wait(Wait::NoWait).build().unwrap();
    let app = router(IdempotencyLayer::new(pool.clone(), inbox), &ctl);
    let first = tokio::spawn({
        let app = app.clone();
        async move { post_key(&app, "nw", &[("x-gate", "1")], "{}").await }
    });
    ctl.entered.notified().await;
    let busy = post_key(&app, "nw", &[], "{}").await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{}", busy.text());
    assert_eq!(busy.headers.get("retry-after").unwrap(), "1");
    ctl.gate.add_permits(1);
    let first = first.await.unwrap();
    let again = post_key(&app, "nw", &[], "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(charges_of(&db.pool, "nw").await, 1);
}

/// Without a key (key optional), a handler that sends `ROLLBACK` on the layer's transaction
/// and answers 201. Was: told 201 with nothing committed (the check before COMMIT, `SELECT
/// 1`, only caught an aborted transaction). Now the ROLLBACK is refused, and the check
/// compares the transaction id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_a_handlers_rollback_is_refused_and_never_answered_201_for_nothing() {
    let db = database().await;
    let ctl = ctl();
    let layer = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .required(false)
        .build()
        .unwrap();
    let app = router(layer, &ctl);
    let r = send(
        &app,
        req(
            Method::POST,
            "/charges",
            None,
            &[("x-sql", "ROLLBACK")],
            "{}",
        ),
    )
    .await;
    let charges = all_charges(&db.pool).await;
    assert!(
        !(r.status.is_success() && charges == 0),
        "answered {} {} although nothing committed (charges: {charges})",
        r.status,
        r.text()
    );
}

/// Without a key, a handler that sends `COMMIT` and then answers 500: the 5xx's effects are
/// documented to roll back. Was: the charge stayed committed. Now the COMMIT is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_a_handlers_commit_is_refused_so_a_5xx_rolls_back() {
    let db = database().await;
    let ctl = ctl();
    let layer = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .required(false)
        .build()
        .unwrap();
    let app = router(layer, &ctl);
    let r = send(
        &app,
        req(
            Method::POST,
            "/charges",
            None,
            &[("x-sql", "COMMIT"), ("x-status", "500")],
            "{}",
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        all_charges(&db.pool).await,
        0,
        "a 5xx's effects roll back, says the table; this one's committed"
    );
}

/// A database whose encoding is not UTF-8 (LATIN1, accepted by `migrate`): a final answer
/// whose body is UTF-8 text outside Latin-1 ("€", an emoji). Was: 22P05 at the store, 500
/// on every attempt. Now the layer learns the encoding and stores what is not ASCII as hex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_latin1_database_a_utf8_response_body_is_stored_as_hex_and_replayed() {
    support::init_tracing();
    use sqlx::{Connection, Executor, PgConnection};
    let server = support::server_url().await;
    let name = format!("pgbox_attack_latin1_{}", uuid::Uuid::now_v7().simple());
    let mut admin = PgConnection::connect(&server).await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE DATABASE \"{name}\" TEMPLATE template0 ENCODING 'LATIN1' \
             LC_COLLATE 'C' LC_CTYPE 'C'"
        )))
        .await
        .unwrap();
    admin.close().await.ok();
    let guard = DropDatabase {
        server: server.clone(),
        name: name.clone(),
    };
    let options = std::str::FromStr::from_str(&server)
        .map(|o: sqlx::postgres::PgConnectOptions| o.database(&name))
        .unwrap();
    let outcome = async {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        pgbox::migrate(&pool)
            .await
            .expect("migrate accepts a LATIN1 database");
        sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
        async fn euro(tx: IdempotencyTx) -> Response {
            let mut g = tx.lock().await.unwrap();
            sqlx::query("INSERT INTO charges (key, body_len) VALUES ('e', 0)")
                .execute(&mut **g)
                .await
                .unwrap();
            (StatusCode::CREATED, "charged \u{20ac}5 \u{1f4b6}").into_response()
        }
        let app = Router::new()
            .route("/e", post(euro))
            .route_layer(IdempotencyLayer::new(pool.clone(), inbox()));
        let r = || {
            Request::post("/e")
                .header("idempotency-key", "e")
                .body(Body::empty())
                .unwrap()
        };
        let first = send(&app, r()).await;
        let retry = send(&app, r()).await;
        // A scope outside Latin-1 (an account named in Chinese), with a UTF-8 Location.
        async fn located(tx: IdempotencyTx) -> Response {
            let mut g = tx.lock().await.unwrap();
            sqlx::query("INSERT INTO charges (key, body_len) VALUES ('s', 0)")
                .execute(&mut **g)
                .await
                .unwrap();
            (
                StatusCode::CREATED,
                [(header::LOCATION, "/caf\u{e9}/\u{20ac}")],
                "ok",
            )
                .into_response()
        }
        let scoped = Router::new().route("/s", post(located)).route_layer(
            IdempotencyLayer::builder(pool.clone(), Inbox::new("attack-scoped").unwrap())
                .scope(|_| Some("\u{7528}\u{6237}".to_owned()))
                .build()
                .unwrap(),
        );
        let s = || {
            Request::post("/s")
                .header("idempotency-key", "s")
                .body(Body::empty())
                .unwrap()
        };
        let scoped_first = send(&scoped, s()).await;
        let scoped_retry = send(&scoped, s()).await;
        let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
            .fetch_one(&pool)
            .await
            .unwrap();
        pool.close().await;
        (first, retry, charges, scoped_first, scoped_retry)
    }
    .await;
    drop(guard);
    let (first, retry, charges, scoped_first, scoped_retry) = outcome;
    assert!(
        scoped_first.status == StatusCode::CREATED
            && scoped_retry.replayed()
            && scoped_retry.headers.get("location") == scoped_first.headers.get("location")
            && scoped_first.headers.get("location").map(|v| v.as_bytes())
                == Some("/caf\u{e9}/\u{20ac}".as_bytes()),
        "scoped: first {} {} {:?}; retry {} {} {:?}",
        scoped_first.status,
        scoped_first.text(),
        scoped_first.headers.get("location"),
        scoped_retry.status,
        scoped_retry.text(),
        scoped_retry.headers.get("location"),
    );
    assert!(
        first.status == StatusCode::CREATED
            && retry.status == StatusCode::CREATED
            && retry.replayed()
            && retry.body == first.body
            && charges == 2,
        "first: {} {}; retry: {} {}; charges (1 + 1 scoped): {charges}",
        first.status,
        first.text(),
        retry.status,
        retry.text()
    );
}

/// REPEATABLE READ database default with `Wait::Timeout`: same-key requests waiting in the
/// bounded claim replay once the first commits (not 409, not 500).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_repeatable_read_a_bounded_wait_replays() {
    for level in ["repeatable read", "serializable"] {
        let db = database().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{level}'",
            db.name
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let pool = pool_of(&db, 8).await;
        let ctl = ctl();
        let inbox = Inbox::builder(CONSUMER)
            .wait(Wait::Timeout(Duration::from_secs(60)))
            .build()
            .unwrap();
        let app = router(IdempotencyLayer::new(pool.clone(), inbox), &ctl);
        let first = tokio::spawn({
            let app = app.clone();
            async move { post_key(&app, "bw", &[("x-gate", "1")], "{}").await }
        });
        ctl.entered.notified().await;
        let mut others = Vec::new();
        for _ in 0..5 {
            let app = app.clone();
            others.push(tokio::spawn(async move {
                post_key(&app, "bw", &[], "{}").await
            }));
        }
        until_lock_waiters(&db.pool, 5).await;
        ctl.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{level}");
        for o in others {
            let o = o.await.unwrap();
            assert_eq!(
                (o.status, o.replayed()),
                (StatusCode::CREATED, true),
                "{level}: {}",
                o.text()
            );
        }
        assert_eq!(charges_of(&db.pool, "bw").await, 1, "{level}");
    }
}

/// Drops a database made by a test (also when the test panics), like `TestDb` does.
struct DropDatabase {
    server: String,
    name: String,
}

impl Drop for DropDatabase {
    fn drop(&mut self) {
        use sqlx::{Connection, Executor, PgConnection};
        let (server, name) = (self.server.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&server).await {
                    let _ = admin
                        .execute(sqlx::AssertSqlSafe(format!(
                            "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                        )))
                        .await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}

// ---------------------------------------------------------------------------------------
// The class: what the screened connection cannot see (a nested unit's own connection, a
// nested unit never ended). The layer checks before it stores or commits.
// ---------------------------------------------------------------------------------------

/// Writes a charge, then, by `x-nested`: `commit` / `rollback` sends that on a nested unit's
/// connection (`tx.begin()`: the raw connection, not screened) and drops the unit; `leak`
/// writes a second charge in a nested unit and forgets it (sqlx's depth stays at 2, so a
/// `commit()` would only release the savepoint). Answers `x-status` (default 201).
async fn nested(tx: IdempotencyTx, headers: HeaderMap) -> Response {
    use sqlx::Connection as _;
    let key = tx.key().unwrap_or("<none>").to_owned();
    let mut guard = match tx.lock().await {
        Ok(g) => g,
        Err(e) => return failed(e),
    };
    let charge = "INSERT INTO charges (key, body_len) VALUES ($1, 0)";
    if let Err(e) = sqlx::query(charge).bind(&key).execute(&mut **guard).await {
        return failed(e);
    }
    let mut unit = match guard.begin().await {
        Ok(unit) => unit,
        Err(e) => return failed(e),
    };
    match hdr(&headers, "x-nested") {
        Some("commit") | Some("rollback") => {
            let sql = hdr(&headers, "x-nested").unwrap().to_uppercase();
            if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&mut *unit)
                .await
            {
                return failed(e);
            }
            drop(unit);
        }
        Some("leak") => {
            if let Err(e) = sqlx::query(charge).bind(&key).execute(&mut *unit).await {
                return failed(e);
            }
            std::mem::forget(unit);
        }
        _ => {
            if let Err(e) = unit.commit().await {
                return failed(e);
            }
        }
    }
    let status = hdr(&headers, "x-status")
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    (status, format!("charged {key}")).into_response()
}

fn nested_router(layer: IdempotencyLayer) -> Router {
    Router::new()
        .route("/nested", post(nested))
        .route_layer(layer)
}

fn nested_req(key: Option<&str>, how: &str, status: &str) -> Request<Body> {
    let mut b = Request::post("/nested");
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.header("x-nested", how)
        .header("x-status", status)
        .body(Body::empty())
        .unwrap()
}

fn title(answer: &Answer) -> String {
    serde_json::from_slice::<Value>(&answer.body)
        .ok()
        .and_then(|v| v["title"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// A handler that commits on a nested unit's connection (not screened), then answers 201 or
/// 500: the layer finds the transaction ended before storing anything and says so (not
/// "retry with the same key": the effect before the COMMIT committed with the key's row);
/// a retry is told the key was used without a stored response (not "unreadable"), and
/// nothing runs twice. The pool is left clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_on_a_nested_units_connection_is_answered_honestly_first_and_on_retry() {
    let db = database().await;
    let pool = pool_of(&db, 1).await;
    let app = nested_router(IdempotencyLayer::new(pool.clone(), inbox()));
    for status in ["201", "500"] {
        let key = format!("nested-commit-{status}");
        let first = send(&app, nested_req(Some(&key), "commit", status)).await;
        let retry = send(&app, nested_req(Some(&key), "plain", "201")).await;
        let charges = charges_of(&db.pool, &key).await;
        assert_eq!(
            (first.status, title(&first).as_str()),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Transaction ended by the handler"
            ),
            "{status}: {}",
            first.text()
        );
        assert!(
            !first.text().contains("retry with the same key"),
            "{}",
            first.text()
        );
        assert_eq!(
            (retry.status, title(&retry).as_str()),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Idempotency key used without a stored response"
            ),
            "{status}: {}",
            retry.text()
        );
        assert_eq!(charges, 1, "{status}: the retry must not run again");
        no_pooled_connection_in_a_transaction(&pool, 1).await;
    }
}

/// Without a key: a handler that rolls back on a nested unit's connection and answers 201
/// is not answered 201 for nothing; one that commits there and answers 500 is told that its
/// transaction was ended (its effect committed), not a plain 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_an_end_on_a_nested_units_connection_is_never_answered_as_done() {
    let db = database().await;
    let pool = pool_of(&db, 1).await;
    let layer = IdempotencyLayer::builder(pool.clone(), inbox())
        .required(false)
        .build()
        .unwrap();
    let app = nested_router(layer);
    let r = send(&app, nested_req(None, "rollback", "201")).await;
    assert_eq!(all_charges(&db.pool).await, 0);
    assert_eq!(
        (r.status, title(&r).as_str()),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "Transaction ended by the handler"
        ),
        "{}",
        r.text()
    );
    no_pooled_connection_in_a_transaction(&pool, 1).await;
    let r = send(&app, nested_req(None, "commit", "500")).await;
    assert_eq!(all_charges(&db.pool).await, 1);
    assert_eq!(
        (r.status, title(&r).as_str()),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "Transaction ended by the handler"
        ),
        "{}",
        r.text()
    );
    no_pooled_connection_in_a_transaction(&pool, 1).await;
    // And a nested unit used as intended commits with the request.
    let r = send(&app, nested_req(None, "plain", "201")).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert_eq!(all_charges(&db.pool).await, 2);
}

/// A nested unit the handler never ends (`mem::forget`): sqlx's depth stays at 2, so a
/// `commit()` would only release a savepoint. Keyed or not, final or not, the layer never
/// answers a final response over nothing committed, and never lends the connection on
/// inside the transaction; a retry with the same key runs (nothing was recorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaked_nested_unit_never_turns_the_layers_commit_into_a_release() {
    let db = database().await;
    let pool = pool_of(&db, 1).await;
    let app = nested_router(IdempotencyLayer::new(pool.clone(), inbox()));
    for status in ["201", "500"] {
        let key = format!("leak-{status}");
        let first = send(&app, nested_req(Some(&key), "leak", status)).await;
        let charges = charges_of(&db.pool, &key).await;
        no_pooled_connection_in_a_transaction(&pool, 1).await;
        assert!(
            !(first.status == StatusCode::CREATED && charges != 2),
            "{status}: answered 201 with {charges} charges committed"
        );
        let retry = send(&app, nested_req(Some(&key), "plain", "201")).await;
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "{status}: {}",
            retry.text()
        );
        no_pooled_connection_in_a_transaction(&pool, 1).await;
    }
    let keyless = nested_router(
        IdempotencyLayer::builder(pool.clone(), inbox())
            .required(false)
            .build()
            .unwrap(),
    );
    let before = all_charges(&db.pool).await;
    let r = send(&keyless, nested_req(None, "leak", "201")).await;
    let added = all_charges(&db.pool).await - before;
    no_pooled_connection_in_a_transaction(&pool, 1).await;
    assert!(
        !(r.status == StatusCode::CREATED && added != 2),
        "keyless: answered 201 with {added} charges committed"
    );
}
