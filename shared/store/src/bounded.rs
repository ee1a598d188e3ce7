//! The connection pool every process uses, with a bound on how long Postgres may leave a
//! statement unanswered that does not depend on Postgres.
//!
//! Postgres ends a slow statement itself (`statement_timeout`, SQLSTATE 57014), but a server
//! that stops answering altogether (a paused process, a host gone while its TCP connections
//! stay open) enforces nothing, and its kernel keeps acknowledging the socket, so no TCP
//! timeout fires either: a statement sent to it would wait for as long as it stays silent.
//! [`Pool`], [`Tx`] and [`Conn`] run every statement under a client-side deadline, its
//! *answer bound*: the session's `statement_timeout` plus [`ANSWER_MARGIN`] (the time a
//! cancellation's error takes to arrive), after which the statement fails with a retryable
//! I/O error (`TimedOut`). Its connection goes back to the pool only once the server answers
//! again: the pool reads what a connection still owes (that answer, a queued rollback, a
//! result dropped half read) before taking it back, and takes back one that owes nothing at
//! once, with no round trip (the patched release of `shared/vendor/sqlx-core`).
//! A statement taken straight from the pool may first wait for a connection, so its first
//! answer may take the acquire timeout longer. A stream of rows gets the bound between rows,
//! not over the whole stream. With `statement_timeout` off there is no bound either.
//!
//! That bound is what lets the pool skip its liveness ping on a connection used less than
//! [`PING_AFTER_IDLE`] ago (a round trip before every statement taken from the pool, two of
//! an admission's six): without the bound, a statement on such a connection to a paused
//! server would hang; with it, it fails like any other.
//!
//! The wrappers implement [`sqlx::Executor`], so `query!(…).fetch_one(&pool)` and
//! `.execute(tx.db())` read as before.

use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{BoxStream, Stream};
use sqlx::postgres::{PgConnection, PgPool, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Describe, Either, Execute, Executor, Postgres};

/// Added to `statement_timeout` for the answer bound: the server cancels a statement at its
/// timeout, and the error needs a moment to arrive (more on a loaded machine).
pub const ANSWER_MARGIN: Duration = Duration::from_secs(1);

/// A connection idle at least this long is pinged before it is handed out, so a server that
/// went away while it was idle fails the acquire, within the acquire timeout. One used more
/// recently is handed out at once: its statements carry the answer bound.
pub const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// A Postgres pool whose statements carry the answer bound (see the module docs). Derefs to
/// [`crate::Pool`] for everything that is not a statement (`close`, `size`, `acquire`;
/// a connection taken with `acquire` has no bound).
#[derive(Clone)]
pub struct Pool {
    inner: PgPool,
    /// The sessions' `statement_timeout` (zero: none).
    statement: Duration,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("size", &self.inner.size())
            .field("statement", &self.statement)
            .finish()
    }
}

impl Deref for Pool {
    type Target = PgPool;
    fn deref(&self) -> &PgPool {
        &self.inner
    }
}

impl Pool {
    /// `inner`'s statements bounded for sessions whose `statement_timeout` is `statement`
    /// (zero: no bound).
    pub fn new(inner: PgPool, statement: Duration) -> Self {
        Self { inner, statement }
    }

    /// The `statement_timeout` this pool's sessions start with (zero: none).
    pub fn statement_timeout(&self) -> Duration {
        self.statement
    }

    /// The answer bound of this pool's statements, if any.
    pub fn answer_bound(&self) -> Option<Duration> {
        (!self.statement.is_zero()).then(|| self.statement + ANSWER_MARGIN)
    }

    /// The longest a statement taken straight from the pool may wait for its first answer:
    /// the acquire timeout, then the answer bound.
    fn first_answer(&self) -> Option<Duration> {
        self.answer_bound()
            .map(|a| a + self.inner.options().get_acquire_timeout())
    }

    /// Takes one connection for a few statements in a row (one acquire for all of them),
    /// each carrying the answer bound. `(**pool).acquire()` gives one without it.
    pub async fn acquire(&self) -> Result<Conn, sqlx::Error> {
        Ok(Conn {
            inner: self.inner.acquire().await?,
            answer: self.answer_bound(),
        })
    }

    /// Begins a transaction whose statements, `COMMIT` included, carry the answer bound.
    ///
    /// The begin itself runs in a task the bound does not cancel. sqlx counts a transaction
    /// only once its `BEGIN` is answered, so a begin cut short after sending it would hand
    /// its connection back to the pool with the server inside a transaction nobody ends, and
    /// every autocommit statement later run on that connection would stay uncommitted,
    /// holding its locks. Past the bound the caller has its error; the task's transaction,
    /// once the server answers, is dropped and rolled back as any other.
    pub async fn begin(&self) -> Result<Tx, sqlx::Error> {
        let pool = self.inner.clone();
        let begin = tokio::spawn(async move { pool.begin().await });
        let begun = async {
            begin
                .await
                .unwrap_or_else(|panicked| Err(sqlx::Error::Io(std::io::Error::other(panicked))))
        };
        let inner = within(self.first_answer(), begun).await?;
        Ok(Tx {
            inner,
            answer: self.answer_bound(),
        })
    }
}

/// A transaction from [`Pool::begin`]: statements run on [`Tx::db`]. Dropped without
/// [`Tx::commit`] it rolls back, as sqlx's does.
pub struct Tx {
    inner: sqlx::Transaction<'static, Postgres>,
    answer: Option<Duration>,
}

impl fmt::Debug for Tx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tx").field("answer", &self.answer).finish()
    }
}

impl Tx {
    /// The executor for this transaction's next statement.
    pub fn db(&mut self) -> Bounded<'_> {
        Bounded {
            conn: &mut self.inner,
            answer: self.answer,
        }
    }

    /// Turns this transaction's statement timeout off (`SET LOCAL statement_timeout = 0`)
    /// and with it the answer bound, for work known to take longer (generating test data).
    pub async fn lift_statement_timeout(&mut self) -> Result<(), sqlx::Error> {
        sqlx::query("SET LOCAL statement_timeout = 0")
            .execute(self.db())
            .await?;
        self.answer = None;
        Ok(())
    }

    /// Commits, within the answer bound.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        within(self.answer, self.inner.commit()).await
    }

    /// Rolls back, within the answer bound.
    pub async fn rollback(self) -> Result<(), sqlx::Error> {
        within(self.answer, self.inner.rollback()).await
    }
}

/// A connection from [`Pool::acquire`]: statements run on [`Conn::db`]; back to the pool
/// when dropped.
pub struct Conn {
    inner: sqlx::pool::PoolConnection<Postgres>,
    answer: Option<Duration>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("answer", &self.answer)
            .finish()
    }
}

impl Conn {
    /// The executor for this connection's next statement.
    pub fn db(&mut self) -> Bounded<'_> {
        Bounded {
            conn: &mut self.inner,
            answer: self.answer,
        }
    }
}

/// A transaction's or a [`Conn`]'s connection with the answer bound on its statements.
pub struct Bounded<'c> {
    conn: &'c mut PgConnection,
    answer: Option<Duration>,
}

impl fmt::Debug for Bounded<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bounded")
            .field("answer", &self.answer)
            .finish()
    }
}

/// The error of a statement that got no answer within its bound: an I/O error, so
/// [`crate::StoreError::retryable`] counts it transient (an API request answers 503).
fn silent(bound: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("Postgres gave no answer within {} ms", bound.as_millis()),
    ))
}

async fn within<T>(
    bound: Option<Duration>,
    work: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    match bound {
        None => work.await,
        Some(bound) => tokio::time::timeout(bound, work)
            .await
            .unwrap_or_else(|_| Err(silent(bound))),
    }
}

fn bounded_future<'e, T: Send + 'e>(
    bound: Option<Duration>,
    work: BoxFuture<'e, Result<T, sqlx::Error>>,
) -> BoxFuture<'e, Result<T, sqlx::Error>> {
    match bound {
        None => work,
        Some(_) => Box::pin(within(bound, work)),
    }
}

fn bounded_stream<'e, T: Send + 'e>(
    first: Option<Duration>,
    next: Option<Duration>,
    rows: BoxStream<'e, Result<T, sqlx::Error>>,
) -> BoxStream<'e, Result<T, sqlx::Error>> {
    match (first, next) {
        (Some(first), Some(next)) => Box::pin(Answered {
            rows,
            next,
            waiting: first,
            timer: Box::pin(tokio::time::sleep(first)),
            ended: false,
        }),
        _ => rows,
    }
}

/// A stream of a statement's results that ends with [`silent`] when the next one does not
/// come within its bound (`waiting`: the first one's, then `next` after each).
struct Answered<'e, T> {
    rows: BoxStream<'e, Result<T, sqlx::Error>>,
    next: Duration,
    waiting: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    ended: bool,
}

impl<T> Stream for Answered<'_, T> {
    type Item = Result<T, sqlx::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.rows.as_mut().poll_next(cx) {
            Poll::Ready(Some(item)) => {
                let next = self.next;
                self.waiting = next;
                self.timer
                    .as_mut()
                    .reset(tokio::time::Instant::now() + next);
                Poll::Ready(Some(item))
            }
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => match self.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    self.ended = true;
                    Poll::Ready(Some(Err(silent(self.waiting))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<'p> Executor<'p> for &'_ Pool {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        bounded_stream(
            self.first_answer(),
            self.answer_bound(),
            (&self.inner).fetch_many(query),
        )
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'p: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        bounded_future(self.first_answer(), (&self.inner).fetch_optional(query))
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'p: 'e,
    {
        bounded_future(
            self.first_answer(),
            (&self.inner).prepare_with(sql, parameters),
        )
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'p: 'e,
    {
        bounded_future(self.first_answer(), (&self.inner).describe(sql))
    }
}

impl<'c> Executor<'c> for Bounded<'c> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        bounded_stream(self.answer, self.answer, self.conn.fetch_many(query))
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        bounded_future(self.answer, self.conn.fetch_optional(query))
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        bounded_future(self.answer, self.conn.prepare_with(sql, parameters))
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        bounded_future(self.answer, self.conn.describe(sql))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn rows(delays: &[u64]) -> BoxStream<'static, Result<u64, sqlx::Error>> {
        let delays = delays.to_vec();
        Box::pin(futures::stream::iter(delays).then(|ms| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(ms)
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn rows_that_keep_coming_pass_and_a_silence_ends_the_stream_with_a_retryable_error() {
        let ms = Duration::from_millis;
        // Each row within the bound, the whole stream far beyond it.
        let all: Vec<_> = bounded_stream(Some(ms(100)), Some(ms(50)), rows(&[90, 40, 40, 40]))
            .collect()
            .await;
        assert_eq!(all.iter().filter(|r| r.is_ok()).count(), 4, "{all:?}");

        // The first answer may take `first`, later ones only `next`.
        let cut: Vec<_> = bounded_stream(Some(ms(100)), Some(ms(50)), rows(&[90, 60, 10]))
            .collect()
            .await;
        assert_eq!(cut.len(), 2, "{cut:?}");
        assert!(cut[0].is_ok());
        let err = cut[1].as_ref().unwrap_err();
        assert!(
            crate::StoreError::from(silent(ms(50))).retryable(),
            "a silence is retryable"
        );
        assert!(err.to_string().contains("no answer within 50 ms"), "{err}");

        // No bound: nothing is cut.
        let slow: Vec<_> = bounded_stream(None, None, rows(&[5_000])).collect().await;
        assert!(slow[0].is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_statement_without_an_answer_fails_at_its_bound() {
        let never = Box::pin(std::future::pending::<Result<(), sqlx::Error>>());
        let t0 = tokio::time::Instant::now();
        let err = bounded_future(Some(Duration::from_millis(300)), never)
            .await
            .unwrap_err();
        assert_eq!(t0.elapsed(), Duration::from_millis(300));
        assert!(matches!(err, sqlx::Error::Io(ref e) if e.kind() == std::io::ErrorKind::TimedOut));
    }
}
