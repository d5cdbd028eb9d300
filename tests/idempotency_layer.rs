//! The `Idempotency-Key` layer (`pgbox::idempotency`) in front of a real axum Router, driven
//! in-process with `ServiceExt::oneshot`, against a real database: first runs and replays,
//! fingerprints, concurrency, restarts, expiry, key validation, which responses are stored,
//! scopes, and the transaction the handler shares with the stored response.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use pgbox::idempotency::{Finality, IdempotencyLayer, IdempotencyTx};
use pgbox::{Inbox, Wait};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::TestDb;
use tokio::sync::{Semaphore, mpsc};
use tower::ServiceExt;

const CONSUMER: &str = "http-requests";

const SCHEMA: &str = "
CREATE TABLE charges (id bigserial PRIMARY KEY, amount bigint NOT NULL);
CREATE TABLE items (id bigint PRIMARY KEY, sold boolean NOT NULL DEFAULT false);
";

/// What the handlers share with the test.
struct Handlers {
    /// `/flaky` answers 500 (after writing) while this is above zero.
    failures_left: AtomicU32,
    /// `/slow` waits for a permit after writing...
    gate: Semaphore,
    /// ...and says so here first.
    entered: mpsc::UnboundedSender<()>,
}

type Shared = Arc<Handlers>;

fn failed(e: impl std::fmt::Display) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
}

/// Inserts a charge on the layer's transaction; its id.
async fn charge(tx: &IdempotencyTx, amount: i64) -> Result<i64, Response> {
    let mut tx = tx.lock().await.map_err(failed)?;
    sqlx::query_scalar("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
        .bind(amount)
        .fetch_one(&mut **tx)
        .await
        .map_err(failed)
}

fn created(id: i64, amount: i64) -> Response {
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/charges/{id}")),
            // Not a stored header: the first response has it, replays do not.
            (header::HeaderName::from_static("x-first-run"), "yes".into()),
        ],
        axum::Json(json!({ "id": id, "amount": amount })),
    )
        .into_response()
}

/// `POST /charges {amount}`: 201 with the charge; 422 (final) for a non-positive amount.
async fn post_charge(tx: IdempotencyTx, axum::Json(body): axum::Json<Value>) -> Response {
    let amount = body["amount"].as_i64().unwrap_or_default();
    if amount <= 0 {
        return (StatusCode::UNPROCESSABLE_ENTITY, "amount must be positive").into_response();
    }
    match charge(&tx, amount).await {
        Ok(id) => created(id, amount),
        Err(r) => r,
    }
}

/// `POST /flaky`: writes, then fails with 500 while `failures_left` lasts.
async fn flaky(State(h): State<Shared>, tx: IdempotencyTx) -> Response {
    let id = match charge(&tx, 1).await {
        Ok(id) => id,
        Err(r) => return r,
    };
    let fail = h
        .failures_left
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if fail {
        return (StatusCode::INTERNAL_SERVER_ERROR, "injected failure").into_response();
    }
    created(id, 1)
}

/// `POST /slow`: writes, reports it is inside, and waits for the test's permit.
async fn slow(State(h): State<Shared>, tx: IdempotencyTx) -> Response {
    let id = match charge(&tx, 2).await {
        Ok(id) => id,
        Err(r) => return r,
    };
    h.entered.send(()).ok();
    h.gate.acquire().await.expect("gate").forget();
    created(id, 2)
}

/// `POST /items/{id}/buy`: 200; 404 when there is no such item (not stored); 409 when sold
/// already, marked final (stored).
async fn buy(Path(item): Path<i64>, tx: IdempotencyTx) -> Response {
    let mut tx = match tx.lock().await {
        Ok(tx) => tx,
        Err(e) => return failed(e),
    };
    let row: Option<bool> =
        match sqlx::query_scalar("SELECT sold FROM items WHERE id = $1 FOR UPDATE")
            .bind(item)
            .fetch_optional(&mut **tx)
            .await
        {
            Ok(row) => row,
            Err(e) => return failed(e),
        };
    match row {
        None => (StatusCode::NOT_FOUND, "no such item").into_response(),
        Some(true) => (StatusCode::CONFLICT, Finality::Final, "sold already").into_response(),
        Some(false) => {
            if let Err(e) = sqlx::query("UPDATE items SET sold = true WHERE id = $1")
                .bind(item)
                .execute(&mut **tx)
                .await
            {
                return failed(e);
            }
            (StatusCode::OK, format!("item {item} bought")).into_response()
        }
    }
}

/// `POST /swallow`: writes, runs a failing statement, ignores the error and answers 201.
async fn swallow(tx: IdempotencyTx) -> Response {
    let id = match charge(&tx, 3).await {
        Ok(id) => id,
        Err(r) => return r,
    };
    let mut tx = tx.lock().await.expect("lock");
    let _ignored = sqlx::query("SELECT 1 / 0").execute(&mut **tx).await;
    created(id, 3)
}

/// The stored header values `POST /odd-headers` answers with, in order: one that is not
/// UTF-8 (Latin-1 `é`), one that is UTF-8 but not ASCII, and plain ones.
const ODD_HEADERS: &[(&str, &[u8])] = &[
    ("location", b"/files/caf\xe9"),
    ("content-language", b"en"),
    ("content-language", b"fr-\xe9t\xe9"),
    ("content-language", "d\u{e9}j\u{e0}".as_bytes()),
    ("content-language", b"de"),
];

/// `POST /odd-headers`: 201 with [`ODD_HEADERS`].
async fn odd_headers(tx: IdempotencyTx) -> Response {
    if let Err(r) = charge(&tx, 5).await {
        return r;
    }
    let mut response = (StatusCode::CREATED, "stored").into_response();
    for (name, value) in ODD_HEADERS {
        response.headers_mut().append(
            header::HeaderName::from_static(name),
            HeaderValue::from_bytes(value).unwrap(),
        );
    }
    response
}

/// `POST /level`: 200 with the isolation level of the layer's transaction.
async fn level(tx: IdempotencyTx) -> Response {
    let mut tx = match tx.lock().await {
        Ok(tx) => tx,
        Err(e) => return failed(e),
    };
    match sqlx::query_scalar::<_, String>("SHOW transaction_isolation")
        .fetch_one(&mut **tx)
        .await
    {
        Ok(level) => (StatusCode::OK, level).into_response(),
        Err(e) => failed(e),
    }
}

/// `POST /big`: a final response larger than the tests' stored-body limit.
async fn big(tx: IdempotencyTx) -> Response {
    match charge(&tx, 4).await {
        Ok(_) => (StatusCode::OK, "x".repeat(4096)).into_response(),
        Err(r) => r,
    }
}

struct App {
    router: Router,
    handlers: Shared,
    entered: mpsc::UnboundedReceiver<()>,
}

fn app(layer: IdempotencyLayer) -> App {
    let (tx, entered) = mpsc::unbounded_channel();
    let handlers = Arc::new(Handlers {
        failures_left: AtomicU32::new(0),
        gate: Semaphore::new(0),
        entered: tx,
    });
    let router = Router::new()
        .route("/charges", post(post_charge))
        .route("/flaky", post(flaky))
        .route("/slow", post(slow))
        .route("/items/{id}/buy", post(buy))
        .route("/swallow", post(swallow))
        .route("/big", post(big))
        .route("/odd-headers", post(odd_headers))
        .route("/level", post(level))
        .route_layer(layer)
        .with_state(handlers.clone());
    App {
        router,
        handlers,
        entered,
    }
}

fn inbox() -> Inbox {
    Inbox::new(CONSUMER).unwrap()
}

async fn database() -> TestDb {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(SCHEMA).execute(&db.pool).await.unwrap();
    db
}

/// A whole response.
#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    fn replayed(&self) -> bool {
        match self.headers.get("idempotent-replayed") {
            None => false,
            Some(v) if v == "true" => true,
            Some(v) => panic!("Idempotent-Replayed: {v:?}"),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// The problem document of a refusal made by the layer.
    fn problem(&self) -> Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let problem = self.json();
        assert_eq!(problem["status"], self.status.as_u16());
        problem
    }
}

/// A request with `headers` (each may repeat) and a JSON or empty body.
fn request(path: &str, headers: &[(&str, &[u8])], body: &str) -> Request<Body> {
    let mut builder = Request::post(path).header("content-type", "application/json");
    for (name, value) in headers {
        builder = builder.header(*name, HeaderValue::from_bytes(value).unwrap());
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

async fn send_request(router: &Router, request: Request<Body>) -> Answer {
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: axum::body::to_bytes(body, usize::MAX).await.unwrap(),
    }
}

/// `POST path` with `Idempotency-Key: key` (none for `None`).
async fn post_key(router: &Router, path: &str, key: Option<&str>, body: &str) -> Answer {
    let headers: Vec<(&str, &[u8])> = key
        .map(|k| ("idempotency-key", k.as_bytes()))
        .into_iter()
        .collect();
    send_request(router, request(path, &headers, body)).await
}

async fn charges(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn keys(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox WHERE consumer = $1")
        .bind(CONSUMER)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_stored_response_marked_as_a_replay() {
    let db = database().await;
    let App { router, .. } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));
    let body = r#"{"amount": 250}"#;

    let first = post_key(&router, "/charges", Some("key-1"), body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(first.header("x-first-run"), Some("yes"));
    let id = first.json()["id"].as_i64().unwrap();
    assert_eq!(first.json(), json!({ "id": id, "amount": 250 }));

    for _ in 0..3 {
        let again = post_key(&router, "/charges", Some("key-1"), body).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
        // The stored headers come back; the others do not.
        assert_eq!(again.header("content-type"), Some("application/json"));
        assert_eq!(again.header("location"), Some(&*format!("/charges/{id}")));
        assert_eq!(again.header("x-first-run"), None);
    }
    assert_eq!(charges(&db.pool).await, 1, "one effect for four requests");

    // A final 4xx is stored too: the same invalid request is answered without running.
    let invalid = post_key(&router, "/charges", Some("key-2"), r#"{"amount": 0}"#).await;
    assert_eq!(invalid.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(!invalid.replayed());
    let again = post_key(&router, "/charges", Some("key-2"), r#"{"amount": 0}"#).await;
    assert_eq!((again.status, &again.body), (invalid.status, &invalid.body));
    assert!(again.replayed());

    // The outcome is in the inbox row, readable by people.
    let stored: Value =
        sqlx::query_scalar("SELECT outcome FROM pgbox.inbox WHERE consumer = $1 AND key = $2")
            .bind(CONSUMER)
            .bind("0::key-1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(stored["status"], 201);
    assert_eq!(stored["request"], "POST /charges");
    assert_eq!(stored["body"], std::str::from_utf8(&first.body).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_for_another_request_is_refused_with_422() {
    let db = database().await;
    let App { router, .. } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));
    let first = post_key(&router, "/charges", Some("k"), r#"{"amount": 10}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);

    for (path, body) in [
        // Another body, even one equal as JSON: the fingerprint is of the bytes.
        ("/charges", r#"{"amount": 11}"#),
        ("/charges", r#"{"amount":10}"#),
        // Another query, another path.
        ("/charges?currency=eur", r#"{"amount": 10}"#),
        ("/flaky", r#"{"amount": 10}"#),
    ] {
        let r = post_key(&router, path, Some("k"), body).await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{path} {body}");
        assert!(!r.replayed());
        let problem = r.problem();
        assert_eq!(problem["original_request"], "POST /charges");
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .contains("same method, path, query and body"),
            "{problem}"
        );
    }
    assert_eq!(charges(&db.pool).await, 1, "nothing ran for the reused key");
    // The original request still gets its response.
    let again = post_key(&router, "/charges", Some("k"), r#"{"amount": 10}"#).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

/// Waits until `n` sessions of this database wait on a lock (the claims behind the first
/// request's); bounded.
async fn until_waiting_on_locks(pool: &PgPool, n: i64) {
    for _ in 0..2_000 {
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
    panic!("{n} requests never waited on the first one's claim");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_with_one_key_have_exactly_one_effect() {
    let db = database().await;
    let App {
        router,
        handlers,
        mut entered,
    } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));

    // The first request holds the key, inside its handler...
    let first = tokio::spawn({
        let router = router.clone();
        async move { post_key(&router, "/slow", Some("same"), "").await }
    });
    entered.recv().await.unwrap();
    // ...while five more with the same key arrive and wait on its claim.
    let others: Vec<_> = (0..5)
        .map(|_| {
            let router = router.clone();
            tokio::spawn(async move { post_key(&router, "/slow", Some("same"), "").await })
        })
        .collect();
    until_waiting_on_locks(&db.pool, 5).await;
    handlers.gate.add_permits(1);

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    for other in others {
        let other = other.await.unwrap();
        assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
        assert!(other.replayed(), "answered from the first one");
        assert_eq!(other.body, first.body);
    }
    assert_eq!(charges(&db.pool).await, 1, "exactly one effect");
    assert_eq!(handlers.gate.available_permits(), 0, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_wait_a_key_in_flight_gets_409() {
    let db = database().await;
    let inbox = Inbox::builder(CONSUMER).wait(Wait::NoWait).build().unwrap();
    let App {
        router,
        handlers,
        mut entered,
    } = app(IdempotencyLayer::new(db.pool.clone(), inbox));

    let first = tokio::spawn({
        let router = router.clone();
        async move { post_key(&router, "/slow", Some("busy"), "").await }
    });
    entered.recv().await.unwrap();
    let busy = post_key(&router, "/slow", Some("busy"), "").await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert!(!busy.replayed());
    assert!(
        busy.problem()["detail"]
            .as_str()
            .unwrap()
            .contains("still being processed")
    );

    handlers.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    // Once the first is done, the retry gets its response.
    let later = post_key(&router, "/slow", Some("busy"), "").await;
    assert!(later.replayed());
    assert_eq!(later.body, first.body);
    assert_eq!(charges(&db.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stored_response_survives_a_restart() {
    let db = database().await;
    let body = r#"{"amount": 77}"#;
    let first = {
        // The first "process": its own pool, router and layer.
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(db.options.clone())
            .await
            .unwrap();
        let App { router, .. } = app(IdempotencyLayer::new(pool.clone(), inbox()));
        let first = post_key(&router, "/charges", Some("restart"), body).await;
        drop(router);
        pool.close().await;
        first
    };
    assert_eq!(first.status, StatusCode::CREATED);

    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let App { router, .. } = app(IdempotencyLayer::new(pool.clone(), inbox()));
    let again = post_key(&router, "/charges", Some("restart"), body).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(charges(&db.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_key_runs_again() {
    let db = database().await;
    let layer = IdempotencyLayer::new(db.pool.clone(), inbox());
    assert_eq!(layer.retention(), Duration::from_secs(24 * 3600));
    let App { router, .. } = app(layer.clone());
    let body = r#"{"amount": 5}"#;
    let first = post_key(&router, "/charges", Some("old"), body).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Within the retention window: kept, replayed.
    assert_eq!(layer.purge_expired().await.unwrap(), 0);
    assert!(
        post_key(&router, "/charges", Some("old"), body)
            .await
            .replayed()
    );

    // Recorded 25 hours ago: purged, and the key runs as a first request.
    sqlx::query(
        "UPDATE pgbox.inbox SET processed_at = processed_at - interval '25 hours' \
         WHERE consumer = $1",
    )
    .bind(CONSUMER)
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(layer.purge_expired().await.unwrap(), 1);
    let again = post_key(&router, "/charges", Some("old"), body).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());
    assert_ne!(again.json()["id"], first.json()["id"], "a new charge");
    assert_eq!(charges(&db.pool).await, 2);
    assert!(
        post_key(&router, "/charges", Some("old"), body)
            .await
            .replayed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_keys_are_refused_with_400_saying_why() {
    let db = database().await;
    let App { router, .. } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));
    let rule = "Idempotency-Key must be 1 to 255 visible ASCII characters (0x21 to 0x7E";
    let too_long = "k".repeat(256);
    let cases: [(&[&[u8]], &str); 6] = [
        (&[b"with space"], "it contains a space"),
        (&[b""], "it is empty"),
        (&[too_long.as_bytes()], "it has 256 characters"),
        (&[b"tab\there"], "it contains a tab"),
        (&["clé".as_bytes()], "it contains a non-ASCII byte"),
        (&[b"one", b"two"], "it was sent more than once"),
    ];
    for (values, why) in cases {
        let headers: Vec<(&str, &[u8])> = values.iter().map(|v| ("idempotency-key", *v)).collect();
        let r = send_request(&router, request("/charges", &headers, r#"{"amount": 1}"#)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{values:?}");
        let detail = r.problem()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(rule), "{detail}");
        assert!(detail.ends_with(why), "{values:?}: {detail}");
    }
    let missing = post_key(&router, "/charges", None, r#"{"amount": 1}"#).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    let detail = missing.problem()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("requires an Idempotency-Key header"),
        "{detail}"
    );
    assert!(detail.contains(rule), "{detail}");
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (0, 0));

    // What the 400 says is what is enforced: 255 visible characters, every one of them.
    let longest: String = (0x21u8..=0x7e).map(char::from).cycle().take(255).collect();
    let r = post_key(&router, "/charges", Some(&longest), r#"{"amount": 1}"#).await;
    assert_eq!(r.status, StatusCode::CREATED, "{r:?}");
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (1, 1));

    // A configured limit is the one the 400 states.
    let short = IdempotencyLayer::builder(db.pool.clone(), Inbox::new("short").unwrap())
        .max_key_len(8)
        .build()
        .unwrap();
    let App { router, .. } = app(short);
    let r = post_key(&router, "/charges", Some("123456789"), r#"{"amount": 1}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let detail = r.problem()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("must be 1 to 8 visible ASCII"), "{detail}");
    assert!(detail.ends_with("it has 9 characters"), "{detail}");
    let r = post_key(&router, "/charges", Some("12345678"), r#"{"amount": 1}"#).await;
    assert_eq!(r.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_is_not_stored_and_its_effects_roll_back() {
    let db = database().await;
    let App {
        router, handlers, ..
    } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));
    handlers.failures_left.store(2, Ordering::SeqCst);

    for _ in 0..2 {
        let failed = post_key(&router, "/flaky", Some("retry-me"), "").await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!failed.replayed());
        // The handler wrote before failing: rolled back, with the key.
        assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (0, 0));
    }
    // The retry runs the handler again, and this time its answer is stored.
    let ok = post_key(&router, "/flaky", Some("retry-me"), "").await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(!ok.replayed());
    let again = post_key(&router, "/flaky", Some("retry-me"), "").await;
    assert!(again.replayed());
    assert_eq!(again.body, ok.body);
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (1, 1));

    // Whatever the rule says, a 5xx is never stored.
    let everything_final = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .is_final(|_| true)
        .build()
        .unwrap();
    let App {
        router, handlers, ..
    } = app(everything_final);
    handlers.failures_left.store(1, Ordering::SeqCst);
    let failed = post_key(&router, "/flaky", Some("rule"), "").await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (1, 1));
    let ok = post_key(&router, "/flaky", Some("rule"), "").await;
    assert_eq!((ok.status, ok.replayed()), (StatusCode::CREATED, false));
    // And the replaced rule is the one applied: a 404 is stored now.
    let missing = post_key(&router, "/items/6/buy", Some("rule-404"), "").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let again = post_key(&router, "/items/6/buy", Some("rule-404"), "").await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::NOT_FOUND, true)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_404_before_the_resource_exists_is_not_stored() {
    let db = database().await;
    let App { router, .. } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));

    let missing = post_key(&router, "/items/5/buy", Some("buy-5"), "").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(keys(&db.pool).await, 0, "a 404 is not stored");

    sqlx::query("INSERT INTO items (id) VALUES (5)")
        .execute(&db.pool)
        .await
        .unwrap();
    let bought = post_key(&router, "/items/5/buy", Some("buy-5"), "").await;
    assert_eq!(bought.status, StatusCode::OK, "{bought:?}");
    assert!(!bought.replayed(), "the retry ran, not replayed the 404");
    assert_eq!(bought.body, "item 5 bought");
    assert!(
        post_key(&router, "/items/5/buy", Some("buy-5"), "")
            .await
            .replayed()
    );

    // A 409 the handler marks final is stored, unlike the status rule's default for 409.
    let sold = post_key(&router, "/items/5/buy", Some("buy-5-again"), "").await;
    assert_eq!(sold.status, StatusCode::CONFLICT);
    assert!(!sold.replayed());
    let again = post_key(&router, "/items/5/buy", Some("buy-5-again"), "").await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CONFLICT, true)
    );
    assert_eq!(keys(&db.pool).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_keeps_clients_keys_apart() {
    let db = database().await;
    let layer = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .scope(|request| {
            request
                .headers
                .get("x-client")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .build()
        .unwrap();
    let App { router, .. } = app(layer);
    let body = r#"{"amount": 9}"#;
    let as_client = |client: &'static str| {
        let router = router.clone();
        async move {
            let headers: [(&str, &[u8]); 2] =
                [("idempotency-key", b"1"), ("x-client", client.as_bytes())];
            send_request(&router, request("/charges", &headers, body)).await
        }
    };

    let alice = as_client("alice").await;
    let bob = as_client("bob").await;
    assert_eq!(
        (alice.status, bob.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!bob.replayed(), "bob's key 1 is not alice's");
    assert_ne!(alice.json()["id"], bob.json()["id"]);
    let alice_again = as_client("alice").await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(charges(&db.pool).await, 2);

    // No principal: refused, nothing runs.
    let anonymous = post_key(&router, "/charges", Some("1"), body).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert!(
        anonymous.problem()["detail"]
            .as_str()
            .unwrap()
            .contains("kept per client")
    );
    assert_eq!(charges(&db.pool).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_swallows_a_failed_statement_gets_500_and_nothing_is_stored() {
    let db = database().await;
    let App { router, .. } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));
    for _ in 0..2 {
        let r = post_key(&router, "/swallow", Some("swallowed"), "").await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{r:?}");
        assert!(!r.replayed());
        r.problem();
    }
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (0, 0));

    // Without a key (the key optional), the same handler is not answered 201 either: the
    // transaction is checked before COMMIT, which would silently roll it back.
    let optional = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .required(false)
        .build()
        .unwrap();
    let App { router, .. } = app(optional);
    let r = post_key(&router, "/swallow", None, "").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{r:?}");
    assert_eq!(charges(&db.pool).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_required_key_each_request_runs_in_the_layers_transaction() {
    let db = database().await;
    let layer = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .required(false)
        .build()
        .unwrap();
    let App {
        router, handlers, ..
    } = app(layer);
    let a = post_key(&router, "/charges", None, r#"{"amount": 3}"#).await;
    let b = post_key(&router, "/charges", None, r#"{"amount": 3}"#).await;
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.json()["id"], b.json()["id"]);
    assert_eq!(charges(&db.pool).await, 2, "committed, once per request");

    // A 5xx rolls the keyless request's effects back too.
    handlers.failures_left.store(1, Ordering::SeqCst);
    let failed = post_key(&router, "/flaky", None, "").await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (2, 0));

    // A key, when sent, is honoured.
    let keyed = post_key(&router, "/charges", Some("k"), r#"{"amount": 3}"#).await;
    assert!(
        post_key(&router, "/charges", Some("k"), r#"{"amount": 3}"#)
            .await
            .replayed()
    );
    assert_eq!(keyed.status, StatusCode::CREATED);
    assert_eq!(charges(&db.pool).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limits_are_refused_and_roll_back() {
    let db = database().await;
    let layer = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .max_response_bytes(1024)
        .max_request_bytes(64)
        .build()
        .unwrap();
    let App { router, .. } = app(layer);

    // A final response too large to store: not sent as if stored; nothing committed.
    let r = post_key(&router, "/big", Some("big"), "").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{r:?}");
    assert!(
        r.problem()["detail"]
            .as_str()
            .unwrap()
            .contains("1024 bytes")
    );
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (0, 0));

    // A request body over the limit: 413 before anything runs.
    let padded = format!(r#"{{"amount": 1, "pad": "{}"}}"#, "p".repeat(64));
    let r = post_key(&router, "/charges", Some("large"), &padded).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    r.problem();
    assert_eq!((charges(&db.pool).await, keys(&db.pool).await), (0, 0));
}

#[tokio::test]
async fn settings_out_of_range_are_refused() {
    let pool = PgPoolOptions::new()
        .connect_lazy("postgres://localhost/x")
        .unwrap();
    let builder = || IdempotencyLayer::builder(pool.clone(), Inbox::new("c").unwrap());
    assert!(builder().max_key_len(0).build().is_err());
    assert!(builder().max_key_len(513).build().is_err());
    assert!(builder().max_key_len(512).build().is_ok());
    assert!(builder().header("bad header").build().is_err());
    assert!(builder().store_header(header::SET_COOKIE).build().is_err());
    assert!(
        builder()
            .retention(Duration::from_millis(10))
            .build()
            .is_err()
    );
    assert!(builder().max_response_bytes(0).build().is_err());
}

/// The stored headers' values, byte for byte and in order, as the handler sent them.
fn stored_header_values(answer: &Answer) -> Vec<(String, Vec<u8>)> {
    ["location", "content-language"]
        .iter()
        .flat_map(|name| {
            answer
                .headers
                .get_all(*name)
                .iter()
                .map(|v| (name.to_string(), v.as_bytes().to_vec()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_carries_stored_header_values_byte_for_byte_utf8_or_not() {
    let db = database().await;
    let App { router, .. } = app(IdempotencyLayer::new(db.pool.clone(), inbox()));
    let expected: Vec<(String, Vec<u8>)> = ODD_HEADERS
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_vec()))
        .collect();
    let first = post_key(&router, "/odd-headers", Some("odd"), "").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(stored_header_values(&first), expected);
    for _ in 0..2 {
        let again = post_key(&router, "/odd-headers", Some("odd"), "").await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(
            stored_header_values(&again),
            expected,
            "the replay's stored headers differ from the first response's"
        );
    }
    // And across a restart (another layer, another pool): read back from the row.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let App { router, .. } = app(IdempotencyLayer::new(pool, inbox()));
    let again = post_key(&router, "/odd-headers", Some("odd"), "").await;
    assert!(again.replayed());
    assert_eq!(stored_header_values(&again), expected);
    assert_eq!(charges(&db.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_same_key_requests_replay_on_a_repeatable_read_or_serializable_database() {
    for level in ["repeatable read", "serializable"] {
        let db = database().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER DATABASE \"{}\" SET default_transaction_isolation = '{level}'",
            db.name
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        // New sessions take the database's default.
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect_with(db.options.clone())
            .await
            .unwrap();
        let seen: String = sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(seen, level);
        let App {
            router,
            handlers,
            mut entered,
        } = app(IdempotencyLayer::new(pool.clone(), inbox()));
        let first = tokio::spawn({
            let router = router.clone();
            async move { post_key(&router, "/slow", Some("same"), "").await }
        });
        entered.recv().await.unwrap();
        let others: Vec<_> = (0..3)
            .map(|_| {
                let router = router.clone();
                tokio::spawn(async move { post_key(&router, "/slow", Some("same"), "").await })
            })
            .collect();
        until_waiting_on_locks(&db.pool, 3).await;
        handlers.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{level}: {first:?}");
        for other in others {
            let other = other.await.unwrap();
            assert_eq!(
                (other.status, other.replayed()),
                (StatusCode::CREATED, true),
                "{level}: a waiting retry must get the stored response: {:?}",
                String::from_utf8_lossy(&other.body)
            );
            assert_eq!(other.body, first.body);
        }
        assert_eq!(charges(&db.pool).await, 1, "{level}");
        // The handler's transaction ran at the database's level: the layer does not lower it.
        let App { router, .. } = app(IdempotencyLayer::builder(
            pool.clone(),
            Inbox::new("levels").unwrap(),
        )
        .required(false)
        .build()
        .unwrap());
        let r = post_key(&router, "/level", Some("lvl"), "").await;
        assert_eq!(r.status, StatusCode::OK, "{r:?}");
        assert_eq!(r.body, level, "with a key");
        let r = post_key(&router, "/level", None, "").await;
        assert_eq!(r.body, level, "without a key");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_key_is_never_told_to_retry_with_the_same_key() {
    let db = database().await;
    let optional = IdempotencyLayer::builder(db.pool.clone(), inbox())
        .required(false)
        .build()
        .unwrap();
    let App { router, .. } = app(optional);
    let r = post_key(&router, "/swallow", None, "").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{r:?}");
    let detail = r.problem()["detail"].as_str().unwrap().to_owned();
    assert!(
        !detail.contains("key"),
        "a request sent without a key is told: {detail}"
    );
    // With a key, the same failure says to retry with it.
    let r = post_key(&router, "/swallow", Some("s"), "").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{r:?}");
    let detail = r.problem()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("retry with the same"), "{detail}");
}
