//! Operating queries shared by the SQL stores: a page of records in record-id order (keyset
//! paging on the `record_id` index: a page starts after the previous page's last id, never at an
//! offset), one record by its id, forgetting one that is not in flight, and resolving an uncertain
//! one.

/// `SELECT` of a page, by id, and the forget `DELETE`, for one table and one placeholder style.
/// Parameters of the page: after (record id or NULL), now, state, principal, started before,
/// limit.
macro_rules! admin_statements {
    ($table:literal, $p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $p6:literal) => {
        pub(crate) const LIST: &str = concat!(
            "SELECT ",
            $crate::row::record_columns!(),
            " FROM ",
            $table,
            " WHERE (",
            $p1,
            " IS NULL OR record_id > ",
            $p1,
            ") AND expires_at > ",
            $p2,
            " AND (",
            $p3,
            " IS NULL OR state = ",
            $p3,
            ") AND (",
            $p4,
            " IS NULL OR principal = ",
            $p4,
            ") AND (",
            $p5,
            " IS NULL OR started_at <= ",
            $p5,
            ") ORDER BY record_id LIMIT ",
            $p6
        );
        pub(crate) const BY_ID: &str =
            concat!("SELECT ", $crate::row::record_columns!(), " FROM ", $table, " WHERE record_id = ", $p1);
        pub(crate) const FORGET: &str = concat!(
            "DELETE FROM ",
            $table,
            " WHERE record_id = ",
            $p1,
            " AND state <> 'in_flight' RETURNING ",
            $crate::row::record_columns!()
        );
    };
}

/// The resolution `UPDATE` of an uncertain record, for one table and one placeholder style.
/// Parameters: record id, status, headers, body, body encoding, expires at.
macro_rules! resolve_statement {
    ($table:literal, $p1:literal, $p2:literal, $p3:literal, $p4:literal, $p5:literal, $p6:literal) => {
        pub(crate) const RESOLVE: &str = concat!(
            "UPDATE ",
            $table,
            " SET state = 'completed', response_status = ",
            $p2,
            ", response_headers = ",
            $p3,
            ", response_body = ",
            $p4,
            ", response_encoding = ",
            $p5,
            ", expires_at = ",
            $p6,
            " WHERE record_id = ",
            $p1,
            " AND state = 'uncertain' RETURNING ",
            $crate::row::record_columns!()
        );
    };
}

#[cfg(feature = "sqlite")]
pub(crate) mod sqlite {
    admin_statements!("idempotency_records", "?1", "?2", "?3", "?4", "?5", "?6");
    resolve_statement!("idempotency_records", "?1", "?2", "?3", "?4", "?5", "?6");
}

#[cfg(feature = "postgres")]
pub(crate) mod postgres {
    admin_statements!(
        "idempotency_records",
        "$1::bytea",
        "$2::timestamptz",
        "$3::text",
        "$4::text",
        "$5::timestamptz",
        "$6::bigint"
    );
    resolve_statement!(
        "idempotency_records",
        "$1::bytea",
        "$2::int4",
        "$3::text",
        "$4::bytea",
        "$5::text",
        "$6::timestamptz"
    );
}

#[cfg(feature = "postgres")]
pub(crate) mod partitioned {
    admin_statements!(
        "idempotency_records_by_day",
        "$1::bytea",
        "$2::timestamptz",
        "$3::text",
        "$4::text",
        "$5::timestamptz",
        "$6::bigint"
    );
    resolve_statement!(
        "idempotency_records_by_day",
        "$1::bytea",
        "$2::int4",
        "$3::text",
        "$4::bytea",
        "$5::text",
        "$6::timestamptz"
    );
}

/// Runs the operating queries on one pool, decoding rows with `$decode`; implements
/// `list_records`, `get_by_id` and `forget` as inherent helpers named `admin_*`. A principal to
/// filter by is given to the database as `$stored` makes it (the form its rows hold it in).
macro_rules! admin_methods {
    ($store:ty, $statements:path, $decode:path, $ts:expr, $stored:expr) => {
        impl $store {
            async fn admin_list(
                &self,
                query: &idempotency::RecordQuery,
            ) -> Result<idempotency::RecordPage, idempotency::StoreError> {
                use $statements as sql;
                let after = query.cursor_record_id()?;
                let size = query.page_size();
                let ts = $ts;
                let rows = sqlx::query(sql::LIST)
                    .bind(after.as_ref().map(|a| a.as_bytes().as_slice()))
                    .bind(ts(query.now))
                    .bind(query.state.map(|s| s.as_str()))
                    .bind(query.principal.as_ref().map(|p| $stored(p.as_str())))
                    .bind(query.started_before.map(&ts))
                    .bind(size as i64 + 1)
                    .fetch_all(&self.pool)
                    .await
                    .map_err($crate::row::db_error)?;
                let records = rows.iter().map($decode).collect::<Result<Vec<_>, _>>()?;
                Ok(idempotency::RecordPage::from_sorted(records, size))
            }

            async fn admin_get_by_id(
                &self,
                id: &idempotency::RecordId,
            ) -> Result<Option<idempotency::Record>, idempotency::StoreError> {
                use $statements as sql;
                let row = sqlx::query(sql::BY_ID)
                    .bind(id.as_bytes().as_slice())
                    .fetch_optional(&self.pool)
                    .await
                    .map_err($crate::row::db_error)?;
                row.as_ref().map($decode).transpose()
            }

            /// The `DELETE` is the atomic step: it deletes only a record that is not in flight.
            /// When it deleted nothing, a read tells an in-flight record from an absent one; a
            /// record that completed or failed between the two is deleted on the next round.
            async fn admin_forget(
                &self,
                id: &idempotency::RecordId,
            ) -> Result<idempotency::Forget, idempotency::StoreError> {
                use $statements as sql;
                for _ in 0..3 {
                    let row = sqlx::query(sql::FORGET)
                        .bind(id.as_bytes().as_slice())
                        .fetch_optional(&self.pool)
                        .await
                        .map_err($crate::row::db_error)?;
                    if let Some(row) = row {
                        return Ok(idempotency::Forget::Forgotten($decode(&row)?));
                    }
                    match self.admin_get_by_id(id).await? {
                        None => return Ok(idempotency::Forget::Absent),
                        Some(r) if r.state == idempotency::RecordState::InFlight => {
                            return Ok(idempotency::Forget::InFlight(r));
                        }
                        Some(_) => continue,
                    }
                }
                Err(idempotency::StoreError::unavailable($crate::admin::ForgetDidNotSettle))
            }

            /// The `UPDATE` is the atomic step: it completes only an uncertain record. When it
            /// changed nothing, a read tells a record in another state from an absent one; a
            /// record that became uncertain between the two is resolved on the next round.
            async fn admin_resolve(
                &self,
                id: &idempotency::RecordId,
                response: &idempotency::StoredResponse,
                expires_at: idempotency::Timestamp,
            ) -> Result<idempotency::Resolve, idempotency::StoreError> {
                use $statements as sql;
                let ts = $ts;
                let headers = response.headers_json();
                for _ in 0..3 {
                    let row = sqlx::query(sql::RESOLVE)
                        .bind(id.as_bytes().as_slice())
                        .bind(i32::from(response.status))
                        .bind(headers.as_str())
                        .bind(response.body.stored_bytes().as_ref())
                        .bind(response.body.encoding().as_str())
                        .bind(ts(expires_at))
                        .fetch_optional(&self.pool)
                        .await
                        .map_err($crate::row::db_error)?;
                    if let Some(row) = row {
                        return Ok(idempotency::Resolve::Resolved($decode(&row)?));
                    }
                    match self.admin_get_by_id(id).await? {
                        None => return Ok(idempotency::Resolve::Absent),
                        Some(r) if r.state == idempotency::RecordState::Uncertain => continue,
                        Some(r) => return Ok(idempotency::Resolve::NotUncertain(r)),
                    }
                }
                Err(idempotency::StoreError::unavailable($crate::admin::ForgetDidNotSettle))
            }
        }
    };
}
pub(crate) use admin_methods;

/// A record that kept changing state between the forget's `DELETE` (or the resolution's
/// `UPDATE`) and the read after it.
#[derive(Debug, thiserror::Error)]
#[error("the record kept changing state while it was being forgotten or resolved")]
pub(crate) struct ForgetDidNotSettle;
