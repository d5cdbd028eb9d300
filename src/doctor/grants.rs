//! The application role's grants: what `Check::Grants` compares against the list that
//! `Migrator::grant_to` applies (`src/grants.rs`).

use super::*;
use crate::grants;

/// One privilege the role lacks.
struct Missing {
    /// `schema`, `table`, `sequence` or `function`.
    kind: &'static str,
    /// The object, schema-qualified.
    object: String,
    privilege: String,
}

impl Doctor {
    /// The role whose grants are checked: [`Doctor::application_role`], or the role running
    /// the doctor.
    pub(super) async fn grants_role(&self, conn: &mut PgConnection) -> Result<String> {
        match &self.application_role {
            Some(role) => Ok(role.as_str().to_owned()),
            None => Ok(sqlx::query_scalar("SELECT current_user::text")
                .persistent(false)
                .fetch_one(&mut *conn)
                .await?),
        }
    }

    /// Every privilege of the grant list that `role` lacks on the objects of the applied
    /// migrations (`versions`; `None`: all of this build's).
    pub(super) async fn check_grants(
        &self,
        conn: &mut PgConnection,
        versions: Option<&BTreeSet<i32>>,
    ) -> Result<Vec<Finding>> {
        let s = &self.schema;
        let role = self.grants_role(conn).await?;
        let applied = |v: i32| versions.is_none_or(|set| set.contains(&v));
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = $1)",
        )
        .persistent(false)
        .bind(&role)
        .fetch_one(&mut *conn)
        .await?;
        if !exists {
            return Ok(vec![
                Finding::new(
                    Severity::Critical,
                    Code::MissingGrant,
                    format!("role {role:?} does not exist"),
                    "Check the role given with --role (`Doctor::application_role`): it must be \
                     the role your services connect as."
                        .to_owned(),
                )
                .subject(role.clone())
                .details(json!({ "role": role })),
            ]);
        }
        let superuser: bool =
            sqlx::query_scalar("SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = $1")
                .persistent(false)
                .bind(&role)
                .fetch_one(&mut *conn)
                .await?;

        // (kind, object, privilege) to test.
        let mut wanted: Vec<(&'static str, String, String)> =
            vec![("schema", s.as_str().to_owned(), "USAGE".to_owned())];
        for (table, privileges, since) in grants::TABLES {
            if applied(*since) {
                for p in *privileges {
                    wanted.push(("table", format!("{s}.\"{table}\""), (*p).to_owned()));
                }
            }
        }
        for p in grants::HISTORY_PRIVILEGES {
            wanted.push(("table", format!("{s}.\"{HISTORY_TABLE}\""), (*p).to_owned()));
        }
        for (sequence, privileges, since) in grants::SEQUENCES {
            if applied(*since) {
                for p in *privileges {
                    wanted.push(("sequence", format!("{s}.\"{sequence}\""), (*p).to_owned()));
                }
            }
        }
        for (function, since) in grants::FUNCTIONS {
            if applied(*since) {
                wanted.push(("function", format!("{s}.{function}"), "EXECUTE".to_owned()));
            }
        }

        // Without USAGE on the schema, the role cannot even name the objects in it (nor can
        // the doctor look them up as that role): report that alone.
        let usage: bool =
            sqlx::query_scalar("SELECT pg_catalog.has_schema_privilege($1, $2, 'USAGE')")
                .persistent(false)
                .bind(&role)
                .bind(s.as_str())
                .fetch_one(&mut *conn)
                .await?;
        if !usage {
            wanted.truncate(1);
        }
        let kinds: Vec<&str> = wanted.iter().map(|w| w.0).collect();
        let objects: Vec<&str> = wanted.iter().map(|w| w.1.as_str()).collect();
        let privileges: Vec<&str> = wanted.iter().map(|w| w.2.as_str()).collect();
        // Objects that do not exist (dropped by hand) are the indexes check's business: a
        // NULL from to_regclass/to_regprocedure skips them instead of failing the check.
        let rows = sqlx::query(
            "SELECT w.kind, w.object, w.privilege FROM unnest($2::text[], $3::text[], $4::text[]) \
               AS w(kind, object, privilege) \
             WHERE NOT CASE w.kind \
               WHEN 'schema' THEN pg_catalog.has_schema_privilege($1, w.object, w.privilege) \
               WHEN 'table' THEN pg_catalog.to_regclass(w.object) IS NULL \
                 OR pg_catalog.has_table_privilege($1, w.object, w.privilege) \
               WHEN 'sequence' THEN pg_catalog.to_regclass(w.object) IS NULL \
                 OR pg_catalog.has_sequence_privilege($1, w.object, w.privilege) \
               ELSE pg_catalog.to_regprocedure(w.object) IS NULL \
                 OR pg_catalog.has_function_privilege($1, w.object, w.privilege) END",
        )
        .persistent(false)
        .bind(&role)
        .bind(&kinds)
        .bind(&objects)
        .bind(&privileges)
        .fetch_all(&mut *conn)
        .await?;
        let mut missing = Vec::new();
        for row in rows {
            let kind: String = row.try_get(0)?;
            missing.push(Missing {
                kind: match kind.as_str() {
                    "schema" => "schema",
                    "table" => "table",
                    "sequence" => "sequence",
                    _ => "function",
                },
                object: row.try_get(1)?,
                privilege: row.try_get(2)?,
            });
        }
        if missing.is_empty() {
            return Ok(vec![
                Finding::new(
                    Severity::Ok,
                    Code::GrantsComplete,
                    format!(
                        "role {role:?} has every privilege pgbox's components need on schema {s} \
                         ({} checked){}",
                        wanted.len(),
                        if superuser { "; it is a superuser" } else { "" }
                    ),
                    if superuser {
                        "Services should not run as a superuser: create an application role, \
                         `pgbox migrate --grant-to ROLE` as the schema's owner, and connect as it."
                            .to_owned()
                    } else {
                        "Nothing to do.".to_owned()
                    },
                )
                .subject(role.clone())
                .details(json!({ "role": role, "checked": wanted.len(), "superuser": superuser })),
            ]);
        }
        let schema = s.as_str();
        let mut findings = Vec::new();
        // One finding per object, its missing privileges together.
        let mut by_object: BTreeMap<(String, &'static str), Vec<String>> = BTreeMap::new();
        for m in missing {
            by_object
                .entry((m.object, m.kind))
                .or_default()
                .push(m.privilege);
        }
        for ((object, kind), privileges) in by_object {
            let list = privileges.join(", ");
            let on = match kind {
                "schema" => "SCHEMA",
                "table" => "TABLE",
                "sequence" => "SEQUENCE",
                _ => "FUNCTION",
            };
            findings.push(
                Finding::new(
                    Severity::Critical,
                    Code::MissingGrant,
                    format!("role {role:?} lacks {list} on {kind} {object}"),
                    format!(
                        "Operations that need it fail with `permission denied` (SQLSTATE 42501, \
                         `DbErrorKind::InsufficientPrivilege`) and roll back. As the schema's \
                         owner, run `pgbox migrate --schema {schema} --grant-to {role}` (it \
                         grants exactly what pgbox needs, idempotently), or `GRANT {list} ON \
                         {on} {object} TO \"{role}\";`."
                    ),
                )
                .subject(object.clone())
                .details(json!({
                    "role": role,
                    "kind": kind,
                    "object": object,
                    "privileges": privileges,
                })),
            );
        }
        Ok(findings)
    }
}
