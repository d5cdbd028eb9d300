//! Least-privilege roles: the schema is migrated by its owner with `grant_to(app)`, and every
//! component then runs as `app`, a role with no CREATE, no ownership and no membership. A
//! role missing a grant gets a typed error and loses nothing; the doctor names what is
//! missing. A hostile `search_path` (a schema ahead of pg_catalog shadowing catalog functions
//! and pgbox's table names) changes nothing.
//!
//! Each test creates LOGIN roles of its own (unique names) and drops them at the end, with
//! what was granted to them in its own database. The shared server trusts local connections,
//! so the roles connect without a password.

mod support;

use std::str::FromStr;
use std::time::Duration;

use pgbox::doctor::{Code, Doctor};
use pgbox::janitor::Janitor;
use pgbox::transport::PgQueue;
use pgbox::{
    CancellationToken, Consumer, DbErrorKind, Envelope, Error, HandlerConnection, Inbox,
    InboxPartitioning, InboxPartitions, LeaseAttempt, Message, Migrator, Outbox, Outcome, Relay,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use support::TestDb;

/// A LOGIN role of this test, dropped (with everything granted to it in `db`) on drop.
struct TestRole {
    name: String,
    server: String,
    database: String,
}

impl TestRole {
    async fn create(db: &TestDb) -> TestRole {
        let name = format!(
            "pgbox_lp_{}",
            &uuid::Uuid::now_v7().simple().to_string()[16..]
        );
        let server = support::server_url().await;
        let mut admin = PgConnection::connect(&server).await.expect("connect");
        admin
            .execute(AssertSqlSafe(format!("CREATE ROLE \"{name}\" LOGIN")))
            .await
            .expect("create role");
        admin.close().await.ok();
        TestRole {
            name,
            server,
            database: db.name.clone(),
        }
    }

    /// A pool of `db` connecting as this role, with extra session settings.
    async fn pool_with(&self, db: &TestDb, settings: &[(&str, &str)]) -> PgPool {
        let options = db
            .options
            .clone()
            .username(&self.name)
            .options(settings.iter().copied());
        PgPoolOptions::new()
            .max_connections(6)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .expect("connect as the test role")
    }

    async fn pool(&self, db: &TestDb) -> PgPool {
        self.pool_with(db, &[]).await
    }
}

impl Drop for TestRole {
    fn drop(&mut self) {
        let (name, server, database) = (
            self.name.clone(),
            self.server.clone(),
            self.database.clone(),
        );
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                // The grants of the test database (if it still exists), then the role.
                let in_db = PgConnectOptions::from_str(&server)
                    .expect("server url")
                    .database(&database);
                if let Ok(mut conn) = PgConnection::connect_with(&in_db).await {
                    let _ = conn
                        .execute(AssertSqlSafe(format!("DROP OWNED BY \"{name}\"")))
                        .await;
                    let _ = conn.close().await;
                }
                if let Ok(mut admin) = PgConnection::connect(&server).await {
                    let _ = admin
                        .execute(AssertSqlSafe(format!("DROP ROLE IF EXISTS \"{name}\"")))
                        .await;
                    let _ = admin.close().await;
                }
            });
        })
        .join();
    }
}

/// The owner's database with pgbox migrated and granted to `role`, and a business table the
/// role may write.
async fn granted(db: &TestDb, role: &TestRole, migrator: Migrator) {
    migrator
        .grant_to(&role.name)
        .unwrap()
        .run(&db.pool)
        .await
        .expect("migrate as the owner, granting to the app role");
    db.pool
        .execute(AssertSqlSafe(format!(
            "CREATE TABLE public.effects (key text NOT NULL); \
             GRANT SELECT, INSERT ON public.effects TO \"{}\"",
            role.name
        )))
        .await
        .unwrap();
}

async fn effects(pool: &PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM public.effects WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn record(conn: &mut HandlerConnection<'_>, key: &str) -> Result<(), Error> {
    sqlx::query("INSERT INTO public.effects (key) VALUES ($1)")
        .bind(key)
        .execute(&mut **conn)
        .await?;
    Ok(())
}

/// Every component of the plain layout, as the application role (`app`).
async fn run_every_component(owner: &PgPool, app: &PgPool) {
    let inbox = Inbox::new("billing").unwrap();

    // process: claim, handler, stored outcome; then a duplicate.
    for round in 0..2 {
        let mut tx = app.begin().await.unwrap();
        let outcome = inbox
            .process(&mut tx, "k-process", async |conn| {
                record(conn, "k-process").await?;
                Ok::<_, Error>(7_i64)
            })
            .await
            .expect("process as the app role");
        tx.commit().await.unwrap();
        match (round, outcome) {
            (0, Outcome::Processed(7)) | (1, Outcome::Duplicate(_)) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(effects(owner, "k-process").await, 1);

    // process_and_commit.
    let _ = inbox
        .process_and_commit(app, "k-commit", async |conn| record(conn, "k-commit").await)
        .await
        .expect("process_and_commit as the app role");
    assert_eq!(effects(owner, "k-commit").await, 1);

    // claim_batch.
    let mut tx = app.begin().await.unwrap();
    let claimed = inbox
        .claim_batch(&mut tx, ["b-1", "b-2", "k-process"])
        .await
        .expect("claim_batch as the app role");
    tx.commit().await.unwrap();
    assert_eq!(claimed, vec![true, true, false]);

    // lookup.
    assert!(inbox.lookup(app, "k-commit").await.unwrap().is_some());
    assert!(inbox.lookup(app, "never").await.unwrap().is_none());

    // Lease mode: the token sequence, the lease function, complete.
    let LeaseAttempt::Leased(lease) = inbox
        .lease(app, "k-lease", Duration::from_secs(30))
        .await
        .expect("lease as the app role")
    else {
        panic!("not leased");
    };
    lease.complete(app, &"done").await.expect("complete");
    assert!(matches!(
        inbox.lease(app, "k-lease", Duration::from_secs(30)).await,
        Ok(LeaseAttempt::Duplicate(_))
    ));

    // Outbox::enqueue, in the business transaction.
    let mut tx = app.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("orders", "o-1").ordering_key("a"))
        .await
        .expect("enqueue as the app role");
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("orders", "o-2"))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // A relay drain into the built-in queue.
    let relay = Relay::builder(app.clone(), PgQueue::new(app.clone()))
        .build()
        .unwrap();
    let drained = relay.drain().await.expect("relay drain as the app role");
    assert_eq!(drained.published, 2, "{drained:?}");

    // The queue's consumer runner.
    let consumer = Consumer::builder(
        app.clone(),
        PgQueue::new(app.clone()),
        "orders",
        Inbox::new("orders-consumer").unwrap(),
    )
    .poll_interval(Duration::from_millis(50))
    // Limits: advisory-lock slots need nothing; the rate buckets are a table of the schema.
    .limit(pgbox::Limit::concurrency("orders", 2))
    .limit(pgbox::Limit::rate("orders", 100.0).per_key_prefix('-'))
    .build()
    .unwrap();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            consumer
                .run(
                    async |envelope: &Envelope, conn: &mut HandlerConnection<'_>| {
                        record(conn, &format!("msg-{}", envelope.id)).await
                    },
                    shutdown,
                )
                .await
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM public.effects WHERE key LIKE 'msg-%'")
                .fetch_one(owner)
                .await
                .unwrap();
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
            .fetch_one(owner)
            .await
            .unwrap();
        if n == 2 && left == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "consumed {n}, left {left}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let stats = run.await.unwrap().expect("consumer as the app role");
    assert_eq!(stats.processed, 2, "{stats:?}");
    let buckets: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.rate_limits")
        .fetch_one(owner)
        .await
        .unwrap();
    assert!(buckets >= 1, "the app role took its tokens");

    // Status and the janitor (gauges included).
    pgbox::status(app, "pgbox").await.expect("status");
    let janitor = Janitor::builder(app.clone()).build().unwrap();
    let pass = janitor.run_once().await.expect("janitor as the app role");
    assert!(pass.lock.is_held(), "{pass:?}");
    janitor.release().await.unwrap();
    let purged = inbox
        .purge_older_than(app, Duration::from_secs(86_400))
        .await
        .expect("purge as the app role");
    assert_eq!(purged, 0);

    // The doctor, as the app role: its grants are complete.
    let report = Doctor::new()
        .check(app)
        .await
        .expect("doctor as the app role");
    assert!(
        report.with_code(Code::GrantsComplete).next().is_some(),
        "{report:#?}"
    );
    assert!(report.with_code(Code::MissingGrant).next().is_none());
}

#[tokio::test]
async fn every_component_runs_as_the_application_role() {
    support::init_tracing();
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    granted(&db, &role, Migrator::new()).await;
    let app = role.pool(&db).await;

    run_every_component(&db.pool, &app).await;

    // Least privilege: the role creates nothing and owns nothing.
    let err = sqlx::query("CREATE TABLE pgbox.intruder (x int)")
        .execute(&app)
        .await
        .map_err(Error::from)
        .unwrap_err();
    assert_eq!(err.db_kind(), Some(DbErrorKind::InsufficientPrivilege));
    let err = sqlx::query("TRUNCATE pgbox.inbox")
        .execute(&app)
        .await
        .map_err(Error::from)
        .unwrap_err();
    assert_eq!(err.db_kind(), Some(DbErrorKind::InsufficientPrivilege));

    // Grants are re-applied, idempotently, on every run (nothing pending).
    let report = Migrator::new()
        .grant_to(&role.name)
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    assert!(report.applied.is_empty());
    app.close().await;
}

#[tokio::test]
async fn the_partitioned_inbox_runs_as_the_application_role() {
    support::init_tracing();
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    granted(
        &db,
        &role,
        Migrator::new().partitioned_inbox(
            InboxPartitioning::every(Duration::from_secs(1))
                .minimum_retention(Duration::from_secs(1))
                .ahead(2),
        ),
    )
    .await;
    let app = role.pool(&db).await;
    let inbox = Inbox::builder("billing").partitioned(true).build().unwrap();

    let mut tx = app.begin().await.unwrap();
    let outcome = inbox
        .process(&mut tx, "p-1", async |conn| record(conn, "p-1").await)
        .await
        .expect("partitioned claim as the app role");
    assert!(matches!(outcome, Outcome::Processed(())));
    tx.commit().await.unwrap();
    let mut tx = app.begin().await.unwrap();
    assert_eq!(
        inbox.claim_batch(&mut tx, ["p-1", "p-2"]).await.unwrap(),
        vec![false, true]
    );
    tx.commit().await.unwrap();

    // Partitions ahead are created through the SECURITY DEFINER function: owned by the
    // migrating role, not by the app role.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let partitions = InboxPartitions::new(app.clone());
    let created = partitions
        .create_ahead()
        .await
        .expect("create partitions ahead as the app role");
    assert!(!created.is_empty());
    let owners: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT pg_get_userbyid(c.relowner)::text FROM pg_inherits h \
         JOIN pg_class c ON c.oid = h.inhrelid \
         WHERE h.inhparent = 'pgbox.partitioned_inbox'::regclass",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(!owners.contains(&role.name), "{owners:?}");
    assert!(!partitions.can_drop().await.unwrap());

    // The janitor as the app role: creates ahead, skips expiry (it needs the owner), says so.
    let janitor = Janitor::builder(app.clone())
        .min_retention(Duration::from_secs(1))
        .inbox_retention(Duration::from_secs(1))
        .build()
        .unwrap();
    let pass = janitor.run_once().await.expect("janitor as the app role");
    assert!(pass.lock.is_held());
    assert!(pass.partitions_expiry_needs_owner, "{pass:?}");
    assert!(pass.partitions_dropped.is_empty());
    janitor.release().await.unwrap();

    // Expiry by the app role: a typed error, nothing detached.
    let err = partitions
        .drop_expired(Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(
        err.db_kind(),
        Some(DbErrorKind::InsufficientPrivilege),
        "{err}"
    );
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("must be owner"), "{err}");
    // ...and by the owner it works.
    let dropped = InboxPartitions::new(db.pool.clone())
        .drop_expired(Duration::from_secs(1))
        .await
        .expect("expiry as the owner");
    assert!(!dropped.is_empty());

    let report = Doctor::new().check(&app).await.unwrap();
    assert!(report.with_code(Code::GrantsComplete).next().is_some());
    app.close().await;
}

#[tokio::test]
async fn a_missing_grant_is_a_typed_error_that_loses_nothing() {
    support::init_tracing();
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    granted(&db, &role, Migrator::new()).await;
    let app = role.pool(&db).await;
    let r = &role.name;
    // The stored outcome is an UPDATE of the claimed row, after the handler's effects.
    db.pool
        .execute(AssertSqlSafe(format!(
            "REVOKE UPDATE ON pgbox.inbox FROM \"{r}\""
        )))
        .await
        .unwrap();

    let inbox = Inbox::new("billing").unwrap();
    let mut tx = app.begin().await.unwrap();
    let err = inbox
        .process(&mut tx, "k-1", async |conn| {
            record(conn, "k-1").await?;
            Ok::<_, Error>(1_i32)
        })
        .await
        .unwrap_err();
    drop(tx);
    assert_eq!(
        err.db_kind(),
        Some(DbErrorKind::InsufficientPrivilege),
        "{err}"
    );
    assert!(!err.is_retryable());
    assert_eq!(err.sqlstate().as_deref(), Some("42501"));
    let text = err.to_string();
    assert!(text.contains("insufficient privilege"), "{text}");
    assert!(text.contains("permission denied for table inbox"), "{text}");
    // Nothing of it committed: neither the claim nor the handler's effect.
    assert_eq!(effects(&db.pool, "k-1").await, 0);
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.inbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(claims, 0);

    // process_and_commit: the handler's enqueue is refused; nothing commits.
    db.pool
        .execute(AssertSqlSafe(format!(
            "GRANT UPDATE ON pgbox.inbox TO \"{r}\"; REVOKE INSERT ON pgbox.outbox FROM \"{r}\""
        )))
        .await
        .unwrap();
    let err = inbox
        .process_and_commit(&app, "k-2", async |conn| {
            record(conn, "k-2").await?;
            Outbox::new()
                .enqueue(conn, Message::bytes("orders", "x"))
                .await?;
            Ok::<(), Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.db_kind(), Some(DbErrorKind::InsufficientPrivilege));
    assert!(err.to_string().contains("outbox"), "{err}");
    assert_eq!(effects(&db.pool, "k-2").await, 0);
    assert!(inbox.lookup(&app, "k-2").await.unwrap().is_none());

    // The doctor names it: for the role given, and as the role itself.
    let report = Doctor::new()
        .application_role(r)
        .unwrap()
        .check(&db.pool)
        .await
        .unwrap();
    let missing: Vec<_> = report.with_code(Code::MissingGrant).collect();
    assert_eq!(missing.len(), 1, "{missing:#?}");
    assert!(missing[0].message.contains("INSERT"), "{missing:#?}");
    assert_eq!(missing[0].subject.as_deref(), Some("\"pgbox\".\"outbox\""));
    let report = Doctor::new().check(&app).await.unwrap();
    assert!(report.with_code(Code::MissingGrant).next().is_some());
    // The advice's GRANT, run as the owner, is what was missing.
    let grant = missing[0]
        .advice
        .split('`')
        .find(|s| s.starts_with("GRANT ") && s.ends_with(';'))
        .expect("a GRANT in the advice")
        .to_owned();
    sqlx::raw_sql(AssertSqlSafe(grant))
        .execute(&db.pool)
        .await
        .unwrap();
    let report = Doctor::new().check(&app).await.unwrap();
    assert!(
        report.with_code(Code::MissingGrant).next().is_none(),
        "{report:#?}"
    );
    // Without USAGE on the schema, the doctor as that role still reports (not an error).
    db.pool
        .execute(AssertSqlSafe(format!(
            "REVOKE USAGE ON SCHEMA pgbox FROM \"{r}\""
        )))
        .await
        .unwrap();
    let report = Doctor::new()
        .check(&app)
        .await
        .expect("doctor without usage");
    assert!(
        report
            .with_code(Code::MissingGrant)
            .any(|f| f.message.contains("USAGE on schema")),
        "{report:#?}"
    );
    // Re-running the migration with grant_to restores everything.
    Migrator::new()
        .grant_to(r)
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let report = Doctor::new()
        .application_role(r)
        .unwrap()
        .check(&db.pool)
        .await
        .unwrap();
    assert!(report.with_code(Code::MissingGrant).next().is_none());
    // An unknown role is a finding, not an error.
    let report = Doctor::new()
        .application_role("pgbox_lp_nobody_here")
        .unwrap()
        .check(&db.pool)
        .await
        .unwrap();
    assert!(report.with_code(Code::MissingGrant).next().is_some());
    app.close().await;
}

#[test]
fn grant_to_validates_the_role_and_writes_the_grants_into_the_script() {
    for bad in [
        "public",
        "App",
        "x\"; DROP ROLE postgres; --",
        "pg_read_all_data",
    ] {
        assert!(Migrator::new().grant_to(bad).is_err(), "{bad}");
        assert!(Doctor::new().application_role(bad).is_err(), "{bad}");
    }
    let sql = Migrator::new()
        .schema("billing")
        .unwrap()
        .grant_to("billing_app")
        .unwrap()
        .to_sql();
    let grants = sql.split("-- V13__").nth(1).expect("V13 in the script");
    assert!(grants.contains("GRANT USAGE ON SCHEMA \"billing\" TO \"billing_app\";"));
    assert!(grants.contains(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE \"billing\".\"inbox\" TO \"billing_app\";"
    ));
    assert!(
        grants.contains("GRANT EXECUTE ON FUNCTION \"billing\".inbox_partitions_create_ahead()")
    );
    assert!(grants.trim_end().ends_with("COMMIT;"));
    assert!(!Migrator::new().to_sql().contains("GRANT USAGE"));
}

#[tokio::test]
async fn the_plain_sql_script_grants_too() {
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    let sql = Migrator::new().grant_to(&role.name).unwrap().to_sql();
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&db.pool)
        .await
        .unwrap();
    let report = Doctor::new()
        .application_role(&role.name)
        .unwrap()
        .check(&db.pool)
        .await
        .unwrap();
    assert!(
        report.with_code(Code::GrantsComplete).next().is_some(),
        "{report:#?}"
    );
}

/// A schema ahead of pg_catalog on the path, shadowing the catalog functions pgbox calls and
/// pgbox's table names: each shadow raises, each table stays empty.
const EVIL: &str = r#"
CREATE SCHEMA evil;
GRANT USAGE ON SCHEMA evil TO PUBLIC;
CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil now()'; END $$;
CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil clock_timestamp()'; END $$;
CREATE FUNCTION evil.hashtext(text) RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil hashtext()'; END $$;
CREATE FUNCTION evil.hashtextextended(text, bigint) RETURNS bigint LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil hashtextextended()'; END $$;
CREATE FUNCTION evil.length(text) RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil length()'; END $$;
CREATE FUNCTION evil.pg_current_xact_id_if_assigned() RETURNS xid8 LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil pg_current_xact_id_if_assigned()'; END $$;
CREATE FUNCTION evil.pg_current_xact_id() RETURNS xid8 LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil pg_current_xact_id()'; END $$;
CREATE FUNCTION evil.gen_random_uuid() RETURNS uuid LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil gen_random_uuid()'; END $$;
CREATE FUNCTION evil.current_setting(text) RETURNS text LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil current_setting()'; END $$;
CREATE FUNCTION evil.pg_advisory_xact_lock(integer, integer) RETURNS void LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil pg_advisory_xact_lock()'; END $$;
CREATE FUNCTION evil.pg_try_advisory_xact_lock(integer, integer) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil pg_try_advisory_xact_lock()'; END $$;
CREATE FUNCTION evil.pg_try_advisory_lock(integer, integer) RETURNS boolean LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil pg_try_advisory_lock()'; END $$;
CREATE FUNCTION evil.pg_backend_pid() RETURNS integer LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil pg_backend_pid()'; END $$;
CREATE FUNCTION evil.make_interval(years integer DEFAULT 0, months integer DEFAULT 0,
  weeks integer DEFAULT 0, days integer DEFAULT 0, hours integer DEFAULT 0,
  mins integer DEFAULT 0, secs double precision DEFAULT 0) RETURNS interval LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil make_interval()'; END $$;
-- (The multi-argument form in FROM is ROWS FROM over pg_catalog.unnest: safe unqualified.)
CREATE FUNCTION evil.unnest(anyarray) RETURNS SETOF anyelement LANGUAGE plpgsql AS
  $$ BEGIN RAISE EXCEPTION 'evil unnest()'; END $$;
CREATE TABLE evil.inbox (LIKE pgbox.inbox);
CREATE TABLE evil.outbox (LIKE pgbox.outbox);
CREATE TABLE evil.queue (LIKE pgbox.queue);
CREATE TABLE evil.pgbox_migrations (LIKE pgbox.pgbox_migrations);
CREATE TABLE evil.pg_class (oid oid);
CREATE TABLE evil.pg_locks (pid int);
GRANT ALL ON ALL TABLES IN SCHEMA evil TO PUBLIC;
"#;

#[tokio::test]
async fn a_hostile_search_path_changes_nothing() {
    support::init_tracing();
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    granted(&db, &role, Migrator::new()).await;
    sqlx::raw_sql(EVIL).execute(&db.pool).await.unwrap();
    let app = role
        .pool_with(&db, &[("search_path", "evil, pg_catalog, public")])
        .await;
    let path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(&app)
        .await
        .unwrap();
    assert_eq!(path, "evil, pg_catalog, public");

    run_every_component(&db.pool, &app).await;

    for table in [
        "inbox",
        "outbox",
        "queue",
        "pgbox_migrations",
        "pg_class",
        "pg_locks",
    ] {
        let n: i64 =
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM evil.{table}")))
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(n, 0, "evil.{table} was written");
    }
    app.close().await;
}

#[tokio::test]
async fn a_hostile_search_path_changes_nothing_for_the_partitioned_inbox() {
    support::init_tracing();
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    granted(
        &db,
        &role,
        Migrator::new().partitioned_inbox(InboxPartitioning::every(Duration::from_secs(3600))),
    )
    .await;
    sqlx::raw_sql(EVIL).execute(&db.pool).await.unwrap();
    let app = role
        .pool_with(&db, &[("search_path", "evil, pg_catalog, public")])
        .await;
    let inbox = Inbox::builder("billing").partitioned(true).build().unwrap();
    for round in 0..2 {
        let mut tx = app.begin().await.unwrap();
        let outcome = inbox
            .process(&mut tx, "p-1", async |conn| {
                record(conn, "p-1").await?;
                Ok::<_, Error>(round)
            })
            .await
            .expect("partitioned claim under a hostile search_path");
        tx.commit().await.unwrap();
        assert_eq!(matches!(outcome, Outcome::Duplicate(_)), round == 1);
    }
    let mut tx = app.begin().await.unwrap();
    assert_eq!(
        inbox.claim_batch(&mut tx, ["p-1", "p-2"]).await.unwrap(),
        vec![false, true]
    );
    tx.commit().await.unwrap();
    InboxPartitions::new(app.clone())
        .create_ahead()
        .await
        .expect("create ahead under a hostile search_path");
    // pgbox's helper functions called directly (the claims call them with a pinned path):
    // pinned too (V13), or written with pg_catalog's names; the lock ids are unchanged.
    sqlx::query("SELECT pgbox.partitioned_inbox_check_isolation()")
        .execute(&app)
        .await
        .expect("the isolation check under a hostile search_path");
    let lock_id = "SELECT pgbox.partitioned_inbox_lock_id('billing', 'p-1')";
    let hostile: i64 = sqlx::query_scalar(lock_id)
        .fetch_one(&app)
        .await
        .expect("the lock id under a hostile search_path");
    let plain: i64 = sqlx::query_scalar(
        "SELECT hashtextextended(length('billing')::text || ':' || 'billing' || 'p-1', 7062)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(hostile, plain);
    let report = Doctor::new().check(&app).await.unwrap();
    assert!(report.with_code(Code::GrantsComplete).next().is_some());
    assert_eq!(effects(&db.pool, "p-1").await, 1);
    app.close().await;
}

fn pgbox_cli(url: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_pgbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("NO_COLOR", "1")
        .output()
        .expect("run pgbox")
}

#[tokio::test]
async fn the_cli_grants_and_the_doctor_checks_a_role() {
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    let r = role.name.as_str();
    let describe = |o: &std::process::Output| {
        format!(
            "exit {:?}\n{}\n{}",
            o.status.code(),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };

    let out = pgbox_cli(&db.url(), &["migrate", "--print-sql", "--grant-to", r]);
    assert!(out.status.success(), "{}", describe(&out));
    let sql = String::from_utf8_lossy(&out.stdout);
    assert!(
        sql.contains(&format!("GRANT USAGE ON SCHEMA \"pgbox\" TO \"{r}\";")),
        "{sql}"
    );

    let out = pgbox_cli(&db.url(), &["migrate", "--grant-to", "Public"]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));

    let out = pgbox_cli(&db.url(), &["migrate"]);
    assert!(out.status.success(), "{}", describe(&out));
    // Not granted yet: critical, exit 8, the missing grants named.
    let out = pgbox_cli(&db.url(), &["doctor", "--role", r, "--json"]);
    assert_eq!(out.status.code(), Some(8), "{}", describe(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let missing = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["code"] == "missing_grant")
        .count();
    assert_eq!(missing, 1, "{report:#}"); // no USAGE on the schema: that alone
    // Granted: every check ok.
    let out = pgbox_cli(&db.url(), &["migrate", "--grant-to", r]);
    assert!(out.status.success(), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("granted role"));
    let out = pgbox_cli(&db.url(), &["doctor", "--role", r]);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("grants_complete"));

    // The CLI as the app role: a refused operation says what to run.
    let mut url = url::Url::parse(&db.url()).unwrap();
    url.set_username(r).unwrap();
    let out = pgbox_cli(url.as_str(), &["migrate"]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = describe(&out);
    assert!(text.contains("--grant-to"), "{text}");
    let out = pgbox_cli(url.as_str(), &["status"]);
    assert!(out.status.success(), "{}", describe(&out));
}

/// A relay whose role may not insert into the queue (its outbox grants only), or may not use
/// the queue's schema, does not try to move batches into it: it publishes through the queue's
/// own pool, as the owner here. With the move (or a look-up of the queue that needs the
/// schema) tried anyway, every round would fail with "permission denied".
#[tokio::test]
async fn a_relay_that_may_not_insert_into_the_queue_publishes_through_the_queues_pool() {
    support::init_tracing();
    let db = TestDb::empty().await;
    let role = TestRole::create(&db).await;
    granted(&db, &role, Migrator::new()).await;
    db.pool
        .execute(AssertSqlSafe(format!(
            "REVOKE INSERT ON pgbox.queue FROM \"{}\"",
            role.name
        )))
        .await
        .unwrap();
    let app = role.pool(&db).await;
    let mut tx = app.begin().await.unwrap();
    for i in 0..5 {
        Outbox::new()
            .enqueue(&mut tx, Message::bytes("orders", format!("o-{i}")))
            .await
            .expect("enqueue as the app role");
    }
    tx.commit().await.unwrap();

    let relay = Relay::builder(app.clone(), PgQueue::new(db.pool.clone()))
        .build()
        .unwrap();
    let drained = relay.drain().await.expect("relay drain as the app role");
    assert_eq!(drained.published, 5, "{drained:?}");
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM pgbox.queue")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(queued, 5);

    // A queue in a schema the role may not even use (migrated by the owner, granted to no
    // one): still published to through the queue's pool, not a failed round.
    Migrator::new()
        .schema("jobs")
        .unwrap()
        .run(&db.pool)
        .await
        .unwrap();
    let mut tx = app.begin().await.unwrap();
    Outbox::new()
        .enqueue(&mut tx, Message::bytes("orders", "o-jobs"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let queue = PgQueue::with_schema(db.pool.clone(), "jobs").unwrap();
    let relay = Relay::builder(app.clone(), queue).build().unwrap();
    let drained = relay
        .drain()
        .await
        .expect("relay drain into a schema it may not use");
    assert_eq!(drained.published, 1, "{drained:?}");
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM jobs.queue")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(queued, 1);
    app.close().await;
}
