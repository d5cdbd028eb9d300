//! The `Idempotency-Key` layer composed with what users plug it into: every position axum
//! allows (`layer`, `route_layer`, on a method router, nested, merged, `nest_service`, a
//! fallback), generated URIs with and without a nest prefix, sqlx pools set up differently
//! (statement cache off, `after_connect`), and a real PgBouncer in transaction mode. What the
//! layer promises must not depend on any of it.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Path;
use axum::http::{HeaderMap, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, post};
use pgbox::idempotency::{IdempotencyLayer, IdempotencyTx};
use pgbox::{Inbox, Pooler};
use rand::Rng;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};
use support::TestDb;
use tower::ServiceExt;

const SCHEMA: &str = "CREATE TABLE charges (id bigserial PRIMARY KEY, account text NOT NULL);";

/// `POST …/charges` under `/accounts/{account}`: a charge for the account in the path, 201
/// with `{"account": …, "id": …}`. Unnamed statements only, so it runs behind a transaction
/// pooler too.
/// (As a fallback outside any nest there is no path parameter: the account is read from the
/// path.)
async fn charge(
    params: Option<Path<HashMap<String, String>>>,
    uri: Uri,
    tx: IdempotencyTx,
) -> Response {
    let account = params
        .and_then(|Path(p)| p.get("account").cloned())
        .or_else(|| {
            uri.path()
                .strip_prefix("/accounts/")
                .and_then(|rest| rest.split('/').next())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "?".to_owned());
    let mut tx = match tx.lock().await {
        Ok(tx) => tx,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    let id: i64 = match sqlx::query_scalar("INSERT INTO charges (account) VALUES ($1) RETURNING id")
        .persistent(false)
        .bind(&account)
        .fetch_one(&mut **tx)
        .await
    {
        Ok(id) => id,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    };
    (
        StatusCode::CREATED,
        axum::Json(json!({ "account": account, "id": id })),
    )
        .into_response()
}

fn route() -> MethodRouter {
    post(charge)
}

/// Every way axum lets the layer guard `POST /accounts/{account}/charges`.
fn positions(layer: &IdempotencyLayer) -> Vec<(&'static str, Router)> {
    let l = || layer.clone();
    let inner_route_layer = || Router::new().route("/charges", route()).route_layer(l());
    vec![
        (
            "flat route_layer",
            Router::new()
                .route("/accounts/{account}/charges", route())
                .route_layer(l()),
        ),
        (
            "flat layer",
            Router::new()
                .route("/accounts/{account}/charges", route())
                .layer(l()),
        ),
        (
            "method router layer",
            Router::new().route("/accounts/{account}/charges", route().layer(l())),
        ),
        (
            "nested route_layer",
            Router::new().nest("/accounts/{account}", inner_route_layer()),
        ),
        (
            "nested layer",
            Router::new().nest(
                "/accounts/{account}",
                Router::new().route("/charges", route()).layer(l()),
            ),
        ),
        (
            "nested method router layer",
            Router::new().nest(
                "/accounts/{account}",
                Router::new().route("/charges", route().layer(l())),
            ),
        ),
        (
            "layer around the nest",
            Router::new()
                .nest(
                    "/accounts/{account}",
                    Router::new().route("/charges", route()),
                )
                .layer(l()),
        ),
        (
            "nested twice",
            Router::new().nest(
                "/accounts",
                Router::new().nest("/{account}", inner_route_layer()),
            ),
        ),
        (
            "merged nest",
            Router::new()
                .route("/health", axum::routing::get(|| async { "ok" }))
                .merge(Router::new().nest("/accounts/{account}", inner_route_layer())),
        ),
        (
            "nest_service",
            Router::new().nest_service("/accounts/{account}", inner_route_layer()),
        ),
        (
            "nested fallback",
            Router::new().nest(
                "/accounts/{account}",
                Router::new()
                    .route("/other", route())
                    .fallback(charge)
                    .layer(l()),
            ),
        ),
        (
            "outer fallback",
            Router::new()
                .route("/health", axum::routing::get(|| async { "ok" }))
                .fallback(charge)
                .layer(l()),
        ),
    ]
}

/// A whole response.
#[derive(Debug)]
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
        self.headers.get("idempotent-replayed").is_some()
    }
}

async fn post_key(router: &Router, uri: &str, key: Option<&str>, body: &str) -> Answer {
    let mut request = Request::post(uri).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: axum::body::to_bytes(body, usize::MAX).await.unwrap(),
    }
}

async fn database() -> TestDb {
    let db = TestDb::migrated().await;
    sqlx::raw_sql(SCHEMA).execute(&db.pool).await.unwrap();
    db
}

async fn charges_of(pool: &PgPool, account: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM charges WHERE account = $1")
        .bind(account)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn stored(pool: &PgPool, consumer: &str, key: &str) -> Value {
    sqlx::query_scalar("SELECT outcome FROM pgbox.inbox WHERE consumer = $1 AND key = $2")
        .bind(consumer)
        .bind(format!("0::{key}"))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_on_another_resource_is_refused_wherever_the_layer_sits() {
    let db = database().await;
    let mut wrong = Vec::new();
    for (i, (position, router)) in positions(&IdempotencyLayer::new(
        db.pool.clone(),
        Inbox::new("http").unwrap(),
    ))
    .into_iter()
    .enumerate()
    {
        let key = format!("k-{i}");
        let (one, two) = (format!("a{i}-1"), format!("a{i}-2"));
        let body = r#"{"amount": 10}"#;
        let first = post_key(
            &router,
            &format!("/accounts/{one}/charges"),
            Some(&key),
            body,
        )
        .await;
        assert_eq!(first.status, StatusCode::CREATED, "{position}: {first:?}");
        assert_eq!(first.json()["account"], one.as_str(), "{position}");
        let other = post_key(
            &router,
            &format!("/accounts/{two}/charges"),
            Some(&key),
            body,
        )
        .await;
        let again = post_key(
            &router,
            &format!("/accounts/{one}/charges"),
            Some(&key),
            body,
        )
        .await;
        let request = stored(&db.pool, "http", &key).await["request"].clone();
        eprintln!(
            "{position}: other account {} replayed={} body={}, stored request {request}",
            other.status,
            other.replayed(),
            String::from_utf8_lossy(&other.body)
        );
        if other.status != StatusCode::UNPROCESSABLE_ENTITY
            || other.replayed()
            || !again.replayed()
            || again.body != first.body
            || request != format!("POST /accounts/{one}/charges")
        {
            wrong.push(position);
        }
        assert_eq!(charges_of(&db.pool, &two).await, 0, "{position}");
        assert_eq!(charges_of(&db.pool, &one).await, 1, "{position}");
    }
    assert!(
        wrong.is_empty(),
        "a key sent for account 1 then account 2 was not refused with 422 (or the stored \
         request line is not what the client sent) with the layer as: {wrong:?}"
    );
}

/// One generated request target: `/accounts/{account}/charges` with an account and a query
/// drawn from characters that are easy to confuse once a prefix is stripped or re-joined.
fn generated_target(rng: &mut impl Rng) -> String {
    const PIECES: &[&str] = &["1", "2", "a", "%2F", "%20", "charges", "-", "_", "~", "10"];
    let account: String = (0..rng.random_range(1..4))
        .map(|_| PIECES[rng.random_range(0..PIECES.len())])
        .collect();
    let query = match rng.random_range(0..3) {
        0 => String::new(),
        1 => "?".to_owned(),
        _ => format!("?x={}", PIECES[rng.random_range(0..PIECES.len())]),
    };
    format!("/accounts/{account}/charges{query}")
}

/// The fingerprint is a function of what the client sent (method, target with the nest prefix
/// and query, body), whatever position the layer has: over generated targets, the same
/// target stores the same fingerprint through a flat and a nested router, and two different
/// targets with one key are refused with 422 in every position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprints_are_of_what_the_client_sent_over_generated_targets() {
    let db = database().await;
    let mut rng = rand::rng();
    let flat = IdempotencyLayer::new(db.pool.clone(), Inbox::new("flat").unwrap());
    let nested = IdempotencyLayer::new(db.pool.clone(), Inbox::new("nested").unwrap());
    let flat = positions(&flat).swap_remove(0).1;
    let nested_positions = positions(&nested);
    let mut mismatches = Vec::new();
    for case in 0..60 {
        let target = generated_target(&mut rng);
        let mut other = generated_target(&mut rng);
        while other == target {
            other = generated_target(&mut rng);
        }
        let (position, nested) = &nested_positions[case % nested_positions.len()];
        let key = format!("g-{case}");
        let body = "{}";
        let a = post_key(&flat, &target, Some(&key), body).await;
        let b = post_key(nested, &target, Some(&key), body).await;
        assert_eq!(
            (a.status, b.status),
            (StatusCode::CREATED, StatusCode::CREATED),
            "{target}: {a:?} {b:?}"
        );
        let (fa, fb) = (
            stored(&db.pool, "flat", &key).await,
            stored(&db.pool, "nested", &key).await,
        );
        if fa["fingerprint"] != fb["fingerprint"] || fa["request"] != fb["request"] {
            mismatches.push(format!("{position} {target}: {fa} vs {fb}"));
        }
        let reused = post_key(nested, &other, Some(&key), body).await;
        if reused.status != StatusCode::UNPROCESSABLE_ENTITY {
            mismatches.push(format!(
                "{position}: {target} then {other} with one key: {}",
                reused.status
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of 60 generated cases: {:#?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(6)]
    );
}

/// Pools users build differently: statement cache off, and an `after_connect` that makes the
/// session serializable. The layer keeps its promises on both: one effect, retries replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_keeps_its_promises_on_differently_built_pools() {
    let db = database().await;
    let no_cache = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(db.options.clone().statement_cache_capacity(0))
        .await
        .unwrap();
    let serializable = PgPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET default_transaction_isolation = 'serializable'")
                    .await
                    .map(|_| ())
            })
        })
        .connect_with(db.options.clone())
        .await
        .unwrap();
    for (name, pool) in [
        ("no statement cache", no_cache),
        ("serializable", serializable),
    ] {
        let layer =
            IdempotencyLayer::new(pool.clone(), Inbox::new(name.replace(' ', "-")).unwrap());
        let router = positions(&layer).swap_remove(3).1;
        let account = name.replace(' ', "-");
        let target = format!("/accounts/{account}/charges");
        let first = post_key(&router, &target, Some("k"), "{}").await;
        assert_eq!(first.status, StatusCode::CREATED, "{name}: {first:?}");
        for _ in 0..3 {
            let again = post_key(&router, &target, Some("k"), "{}").await;
            assert!(again.replayed(), "{name}: {again:?}");
            assert_eq!(again.body, first.body, "{name}");
        }
        assert_eq!(charges_of(&db.pool, &account).await, 1, "{name}");
    }
}

async fn pooled(options: PgConnectOptions, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .unwrap()
}

/// Behind PgBouncer in transaction mode, with the inbox set to `Pooler::Transaction`: the
/// layer with and without keys, and its purges, never fail for the pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_layer_and_its_purges_work_behind_a_transaction_pooler() {
    use support::cluster::Cluster;
    use support::pooler::PgBouncer;

    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let bouncer = PgBouncer::start(&cluster, 4);
    let direct = pooled(cluster.url("postgres").parse().unwrap(), 2).await;
    pgbox::migrate(&direct).await.unwrap();
    sqlx::raw_sql(SCHEMA).execute(&direct).await.unwrap();
    let pool = pooled(bouncer.url("postgres").parse().unwrap(), 16).await;
    let inbox = Inbox::builder("http")
        .pooler(Pooler::Transaction)
        .build()
        .unwrap();
    let layer = IdempotencyLayer::builder(pool.clone(), inbox.clone())
        .required(false)
        .build()
        .unwrap();
    let router = positions(&layer).swap_remove(3).1;

    // 320 requests, 16 at a time: half without a key, half with one (each sent twice).
    let mut tasks = Vec::new();
    for t in 0..16 {
        let router = router.clone();
        tasks.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            for i in 0..20 {
                let key = (i % 2 == 0).then(|| format!("t{t}-{}", i / 4));
                let target = format!("/accounts/p{t}-{i}/charges");
                let target = if i % 4 == 2 {
                    // The second sending of the previous key: the same request.
                    format!("/accounts/p{t}-{}/charges", i - 2)
                } else {
                    target
                };
                let r = post_key(&router, &target, key.as_deref(), "{}").await;
                if r.status != StatusCode::CREATED {
                    failures.push(format!(
                        "{target} key {key:?}: {} {}",
                        r.status,
                        String::from_utf8_lossy(&r.body)
                    ));
                }
            }
            failures
        }));
    }
    let mut failures = Vec::new();
    for t in tasks {
        failures.extend(t.await.unwrap());
    }
    // The purges, 160 calls each, 16 at a time.
    let mut purges = Vec::new();
    for _ in 0..16 {
        let (layer, inbox, pool) = (layer.clone(), inbox.clone(), pool.clone());
        purges.push(tokio::spawn(async move {
            let mut failed = Vec::new();
            for _ in 0..10 {
                if let Err(e) = layer.purge_expired().await {
                    failed.push(format!("purge_expired: {e}"));
                }
                if let Err(e) = inbox.purge_older_than(&pool, Duration::from_secs(60)).await {
                    failed.push(format!("purge_older_than: {e}"));
                }
            }
            failed
        }));
    }
    for p in purges {
        failures.extend(p.await.unwrap());
    }
    let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
    for f in &failures {
        let kind = if f.starts_with("purge_expired") {
            "purge_expired (160 calls)"
        } else if f.starts_with("purge_older_than") {
            "purge_older_than (160 calls)"
        } else if f.contains("key None") {
            "requests without a key (160)"
        } else {
            "requests with a key (160)"
        };
        *kinds.entry(kind).or_default() += 1;
    }
    assert!(
        failures.is_empty(),
        "{} failures behind the pooler: {kinds:?}, e.g. {:#?}",
        failures.len(),
        &failures[..failures.len().min(4)]
    );
    let (charges, keys): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM charges), \
                (SELECT count(*) FROM pgbox.inbox WHERE consumer = 'http')",
    )
    .fetch_one(&direct)
    .await
    .unwrap();
    // 16 tasks × (10 keyless + 5 keys, each run once and replayed once).
    assert_eq!((charges, keys), (16 * 15, 16 * 5));
}

/// A request whose future is dropped while its handler runs (the client hung up, an outer
/// timeout layer fired): nothing of it commits, its key stays free, the retry runs, and no
/// pooled connection is left inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_mid_handler_leaves_nothing_and_its_retry_runs() {
    let db = database().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(db.options.clone())
        .await
        .unwrap();
    let entered = std::sync::Arc::new(tokio::sync::Notify::new());
    let hang = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let handler = {
        let (entered, hang) = (entered.clone(), hang.clone());
        move |tx: IdempotencyTx| async move {
            {
                let mut tx = tx.lock().await.unwrap();
                sqlx::query("INSERT INTO charges (account) VALUES ('dropped')")
                    .execute(&mut **tx)
                    .await
                    .unwrap();
            }
            if hang.load(std::sync::atomic::Ordering::SeqCst) {
                entered.notify_one();
                std::future::pending::<()>().await;
            }
            (StatusCode::CREATED, "charged").into_response()
        }
    };
    let layer = IdempotencyLayer::new(pool.clone(), Inbox::new("dropped").unwrap());
    let router = Router::new()
        .route("/charges", post(handler))
        .route_layer(layer);
    let call = tokio::spawn({
        let router = router.clone();
        async move { post_key(&router, "/charges", Some("d"), "{}").await }
    });
    entered.notified().await;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());

    hang.store(false, std::sync::atomic::Ordering::SeqCst);
    // The one pooled connection comes back out of the dropped transaction: its next
    // statement runs in a transaction of its own (the simple protocol: one message, so the
    // transaction and the statement start together).
    let in_tx = sqlx::raw_sql("SELECT now() <> statement_timestamp()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        !sqlx::Row::get::<bool, _>(&in_tx, 0),
        "the pooled connection is inside a transaction"
    );
    assert_eq!(charges_of(&db.pool, "dropped").await, 0);
    let retry = post_key(&router, "/charges", Some("d"), "{}").await;
    assert_eq!(
        (retry.status, retry.replayed()),
        (StatusCode::CREATED, false),
        "{retry:?}"
    );
    assert_eq!(charges_of(&db.pool, "dropped").await, 1);
}
