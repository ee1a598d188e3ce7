//! Object storage for Takosumi's private artifacts over the S3 protocol (AWS S3, garage,
//! s3s-fs, …) with `aws-sdk-s3`.
//!
//! This crate owns the S3 client setup (static credentials, explicit endpoint and region,
//! path-style addressing, no environment or profile lookups), the operations the steps need
//! (create-only put, capped get, delete, exists, list), the classification of storage
//! failures and the retrying of transient ones with exponential backoff and jitter
//! (`backon`).
//!
//! It must never print or log the secret key, object bodies or object keys (keys of private
//! artifacts are never to appear in a log or an API response): error messages name only the
//! operation, the HTTP status and the S3 error code. It does not decide who may write an
//! object: `If-None-Match: *` is a second line of defence, the database's claims are the
//! first. It never seals or unseals; callers hand it bytes that are already sealed.
#![deny(missing_docs)]

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::{ByteStream, Length};
use aws_sdk_s3::types::{
    BucketLocationConstraint, CompletedMultipartUpload, CompletedPart, CreateBucketConfiguration,
};
use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use takosumi_core::Secret;
use tokio::io::AsyncWriteExt;

/// Where the object store is and how to sign in to it.
#[derive(Debug, Clone)]
pub struct ObjectStoreConfig {
    /// Endpoint URL (`http://127.0.0.1:8014`); `None` uses AWS S3 for `region`.
    pub endpoint: Option<String>,
    /// Signing region (`us-east-1`; garage needs its configured `s3_region`).
    pub region: String,
    /// Access key id.
    pub access_key: String,
    /// Secret access key; handed only to the SDK's static credentials provider.
    pub secret_key: Secret<String>,
    /// The bucket every operation works in.
    pub bucket: String,
    /// How long one request may take.
    pub timeouts: ObjectTimeouts,
}

/// How long one storage request may take before it counts as a transient failure (and is
/// retried with backoff, at most 4 more times). The SDK's own retries are off, so a request
/// is one attempt: `attempt` bounds sending it and reading the answer's head, `operation`
/// the whole call (signing and endpoint resolution included). A server that accepts the
/// connection and never answers therefore fails an operation within about
/// 5 × `attempt` plus the backoff (under 20 s), never hangs a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectTimeouts {
    /// Opening the TCP (and TLS) connection.
    pub connect: Duration,
    /// One attempt of a request.
    pub attempt: Duration,
    /// One call of the SDK.
    pub operation: Duration,
}

impl Default for ObjectTimeouts {
    /// 5 s to connect; 2 min per attempt (an 8 MiB part over a slow link), 150 s per call.
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            attempt: Duration::from_secs(120),
            operation: Duration::from_secs(150),
        }
    }
}

/// Part size of a multipart upload ([`ObjectStore::put_file_if_absent`]); a file up to
/// this size goes up in one request. S3 allows 10,000 parts: objects up to 78 GiB.
pub const PART_LEN: u64 = 8 * 1024 * 1024;

/// What [`ObjectStore::put_if_absent`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The object was written.
    Created,
    /// An object with that key already existed; it was not overwritten.
    AlreadyExists,
}

/// Details of a failed storage request: the operation, the HTTP status and S3 error code
/// when the server answered, and a description. Never contains credentials, object keys or
/// object bodies.
#[derive(Debug, Clone)]
pub struct ObjectFault {
    operation: &'static str,
    status: Option<u16>,
    code: Option<String>,
    detail: String,
}

impl ObjectFault {
    fn new(operation: &'static str, detail: impl Into<String>) -> Self {
        Self {
            operation,
            status: None,
            code: None,
            detail: detail.into(),
        }
    }

    /// The S3 operation that failed (`PutObject`, `GetObject`, …).
    pub fn operation(&self) -> &'static str {
        self.operation
    }

    /// The HTTP status of the server's answer, if there was one.
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The S3 error code (`SlowDown`, `AccessDenied`, …), if the server sent one.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }
}

impl fmt::Display for ObjectFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed", self.operation)?;
        if let Some(status) = self.status {
            write!(f, " with HTTP {status}")?;
        }
        if let Some(code) = &self.code {
            write!(f, " ({code})")?;
        }
        if !self.detail.is_empty() {
            write!(f, ": {}", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for ObjectFault {}

/// Why an object operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// No object with that key (or, for [`ObjectStore::get`], it vanished while reading).
    #[error("object not found")]
    NotFound,
    /// The object is larger than the caller's limit; its body was not read past the limit.
    #[error("object is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        /// The object's size in bytes (at least this many when the server did not say).
        size: u64,
        /// The caller's limit in bytes.
        limit: u64,
    },
    /// A fault that may clear up by itself: timeout, connection error, HTTP 5xx,
    /// throttling. Already retried with backoff before it is returned.
    #[error("object storage temporarily failed in {}", .0.operation())]
    Transient(#[source] ObjectFault),
    /// The store refused the credentials or the request (HTTP 401/403).
    #[error("object storage denied {}", .0.operation())]
    Denied(#[source] ObjectFault),
    /// Any other failure (bad request, missing bucket, bad configuration, …).
    #[error("object storage failed in {}", .0.operation())]
    Other(#[source] ObjectFault),
}

impl ObjectError {
    /// Whether trying again later may succeed: only [`ObjectError::Transient`].
    pub fn retryable(&self) -> bool {
        matches!(self, ObjectError::Transient(_))
    }
}

/// How a failed request is to be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    NotFound,
    Precondition,
    Denied,
    Transient,
    Other,
}

/// S3 error codes that mean "try again later" whatever the status says.
const TRANSIENT_CODES: &[&str] = &[
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
];

/// Classifies a server's answer by HTTP status and S3 error code.
fn classify_status(status: u16, code: Option<&str>) -> Class {
    if code.is_some_and(|c| TRANSIENT_CODES.contains(&c)) {
        return Class::Transient;
    }
    match status {
        408 | 429 | 500..=599 => Class::Transient,
        401 | 403 => Class::Denied,
        412 => Class::Precondition,
        // A 409 on a conditional write is a concurrent conditional write
        // (ConditionalRequestConflict); other 409s (bucket ops) are handled by the caller.
        409 if matches!(
            code,
            Some("ConditionalRequestConflict" | "PreconditionFailed")
        ) =>
        {
            Class::Precondition
        }
        404 if code == Some("NoSuchBucket") => Class::Other,
        404 => Class::NotFound,
        _ => Class::Other,
    }
}

/// Classifies an SDK error and describes it without credentials or keys.
fn classify<E>(operation: &'static str, err: &SdkError<E, HttpResponse>) -> (Class, ObjectFault)
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let mut fault = ObjectFault::new(operation, "");
    let class = match err {
        SdkError::ServiceError(service) => {
            let status = service.raw().status().as_u16();
            let meta = service.err();
            fault.status = Some(status);
            fault.code = meta.code().map(str::to_owned);
            fault.detail = meta.message().unwrap_or_default().to_owned();
            classify_status(status, meta.code())
        }
        SdkError::TimeoutError(_) => {
            fault.detail = DisplayErrorContext(err).to_string();
            Class::Transient
        }
        SdkError::DispatchFailure(dispatch) => {
            fault.detail = DisplayErrorContext(err).to_string();
            if dispatch.is_user() {
                Class::Other
            } else {
                // I/O, timeout or an unclassified connector failure.
                Class::Transient
            }
        }
        SdkError::ResponseError(response) => {
            fault.status = Some(response.raw().status().as_u16());
            fault.detail = DisplayErrorContext(err).to_string();
            // The server answered but the answer could not be read (cut off, garbled).
            Class::Transient
        }
        SdkError::ConstructionFailure(_) => {
            fault.detail = DisplayErrorContext(err).to_string();
            Class::Other
        }
        _ => {
            fault.detail = DisplayErrorContext(err).to_string();
            Class::Other
        }
    };
    (class, fault)
}

/// The usual mapping of a classified failure to an [`ObjectError`].
fn to_error(class: Class, fault: ObjectFault) -> ObjectError {
    match class {
        Class::NotFound => ObjectError::NotFound,
        Class::Transient => ObjectError::Transient(fault),
        Class::Denied => ObjectError::Denied(fault),
        Class::Precondition | Class::Other => ObjectError::Other(fault),
    }
}

/// A conditional write's answer: written, or refused because the key exists (412, or 409
/// from servers that report a conflicting concurrent write).
fn created_unless_exists<T, E>(
    operation: &'static str,
    sent: Result<T, SdkError<E, HttpResponse>>,
) -> Result<PutOutcome, ObjectError>
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match sent {
        Ok(_) => Ok(PutOutcome::Created),
        Err(err) => match classify(operation, &err) {
            (Class::Precondition, _) => Ok(PutOutcome::AlreadyExists),
            (_, fault) if fault.status == Some(409) => Ok(PutOutcome::AlreadyExists),
            (class, fault) => Err(to_error(class, fault)),
        },
    }
}

fn sdk_error<E>(operation: &'static str, err: &SdkError<E, HttpResponse>) -> ObjectError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let (class, fault) = classify(operation, err);
    to_error(class, fault)
}

/// The retry policy: 5 attempts, 100 ms to 5 s apart, with jitter.
fn default_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_max_times(4)
}

/// Runs `attempt` until it succeeds, fails with a non-transient error or the backoff is
/// used up.
async fn with_retries<T, F, Fut>(
    backoff: ExponentialBuilder,
    operation: &'static str,
    attempt: F,
) -> Result<T, ObjectError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ObjectError>>,
{
    attempt
        .retry(backoff)
        .sleep(tokio::time::sleep)
        .when(ObjectError::retryable)
        .notify(|err: &ObjectError, delay: Duration| {
            let detail = match err {
                ObjectError::Transient(fault) => fault.to_string(),
                other => other.to_string(),
            };
            tracing::warn!(
                operation,
                error = %detail,
                retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                "transient object storage failure; retrying"
            );
        })
        .await
}

fn i64_to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A handle on one bucket. Cheap to clone (the SDK client is shared).
#[derive(Clone)]
pub struct ObjectStore {
    client: Client,
    bucket: String,
    region: String,
    backoff: ExponentialBuilder,
}

impl fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectStore")
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

impl ObjectStore {
    /// Builds a client for `cfg`: static credentials, the given region and endpoint,
    /// path-style addressing, SDK-level retries off (this crate retries), and the
    /// connect, attempt and operation timeouts of [`ObjectStoreConfig::timeouts`]. Reads no
    /// environment variables or profile files and makes no request.
    pub async fn connect(cfg: &ObjectStoreConfig) -> Self {
        let credentials = Credentials::new(
            cfg.access_key.clone(),
            cfg.secret_key.expose().clone(),
            None,
            None,
            "takosumi-static",
        );
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(cfg.timeouts.connect)
            .operation_attempt_timeout(cfg.timeouts.attempt)
            .operation_timeout(cfg.timeouts.operation)
            .build();
        let mut builder = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(cfg.region.clone()))
            .credentials_provider(credentials)
            .force_path_style(true)
            .retry_config(RetryConfig::disabled())
            .timeout_config(timeouts);
        if let Some(endpoint) = cfg
            .endpoint
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            builder = builder.endpoint_url(endpoint);
        }
        Self {
            client: Client::from_conf(builder.build()),
            bucket: cfg.bucket.clone(),
            region: cfg.region.clone(),
            backoff: default_backoff(),
        }
    }

    /// The bucket this store works in.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Creates the bucket unless it exists (an "already owned / already exists" answer is
    /// success).
    pub async fn ensure_bucket(&self) -> Result<(), ObjectError> {
        let exists = with_retries(self.backoff, "HeadBucket", || async {
            match self.client.head_bucket().bucket(&self.bucket).send().await {
                Ok(_) => Ok(true),
                Err(err) => match classify("HeadBucket", &err) {
                    // HeadBucket has no body, so a missing bucket is a bare 404.
                    (Class::NotFound, _) => Ok(false),
                    (_, fault) if fault.status == Some(404) => Ok(false),
                    (class, fault) => Err(to_error(class, fault)),
                },
            }
        })
        .await?;
        if exists {
            return Ok(());
        }

        with_retries(self.backoff, "CreateBucket", || async {
            let mut request = self.client.create_bucket().bucket(&self.bucket);
            if self.region != "us-east-1" {
                request = request.create_bucket_configuration(
                    CreateBucketConfiguration::builder()
                        .location_constraint(BucketLocationConstraint::from(self.region.as_str()))
                        .build(),
                );
            }
            match request.send().await {
                Ok(_) => Ok(()),
                Err(err) => {
                    let (class, fault) = classify("CreateBucket", &err);
                    match fault.code() {
                        Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists") => Ok(()),
                        _ => Err(to_error(class, fault)),
                    }
                }
            }
        })
        .await
    }

    /// Writes `body` under `key` only if no object has that key (`If-None-Match: *`).
    ///
    /// The store's conditional put is a second line of defence: some servers let racing
    /// writers both win, and a retried put whose first attempt landed reports
    /// [`PutOutcome::AlreadyExists`].
    pub async fn put_if_absent(&self, key: &str, body: Vec<u8>) -> Result<PutOutcome, ObjectError> {
        let body = Bytes::from(body);
        with_retries(self.backoff, "PutObject", || async {
            let sent = self
                .client
                .put_object()
                .bucket(&self.bucket)
                .key(key)
                .if_none_match("*")
                .body(ByteStream::from(body.clone()))
                .send()
                .await;
            created_unless_exists("PutObject", sent)
        })
        .await
    }

    /// Uploads the file at `path` under `key` only if no object has that key, reading it
    /// one part at a time ([`PART_LEN`]), so memory stays bounded whatever its size: up to
    /// one part in a single conditional put, beyond it a multipart upload completed with
    /// `If-None-Match: *` (aborted when it does not complete).
    pub async fn put_file_if_absent(
        &self,
        key: &str,
        path: &Path,
    ) -> Result<PutOutcome, ObjectError> {
        let size = tokio::fs::metadata(path)
            .await
            .map_err(|e| local("PutObject", "reading the file to upload", &e))?
            .len();
        // A server that refuses the conditional put answers before reading the body and
        // closes the connection, which the client sees as a broken pipe (a transient
        // fault): look first, so the usual "already there" costs no upload.
        if self.exists(key).await? {
            return Ok(PutOutcome::AlreadyExists);
        }
        if size <= PART_LEN {
            let body = tokio::fs::read(path)
                .await
                .map_err(|e| local("PutObject", "reading the file to upload", &e))?;
            return self.put_if_absent(key, body).await;
        }
        let upload_id = with_retries(self.backoff, "CreateMultipartUpload", || async {
            self.client
                .create_multipart_upload()
                .bucket(&self.bucket)
                .key(key)
                .send()
                .await
                .map_err(|err| sdk_error("CreateMultipartUpload", &err))?
                .upload_id()
                .map(str::to_owned)
                .ok_or_else(|| {
                    ObjectError::Other(ObjectFault::new(
                        "CreateMultipartUpload",
                        "the answer has no upload id",
                    ))
                })
        })
        .await?;
        let done = self.upload_parts(key, path, size, &upload_id).await;
        if !matches!(done, Ok(PutOutcome::Created)) {
            // Best effort: an abandoned upload only costs space until the bucket's own
            // lifecycle rule (or the operator) removes it.
            let _ = self
                .client
                .abort_multipart_upload()
                .bucket(&self.bucket)
                .key(key)
                .upload_id(&upload_id)
                .send()
                .await;
        }
        done
    }

    async fn upload_parts(
        &self,
        key: &str,
        path: &Path,
        size: u64,
        upload_id: &str,
    ) -> Result<PutOutcome, ObjectError> {
        let mut parts = Vec::new();
        let mut offset = 0u64;
        let mut number = 1i32;
        while offset < size {
            let len = PART_LEN.min(size - offset);
            let e_tag = with_retries(self.backoff, "UploadPart", || async {
                let body = ByteStream::read_from()
                    .path(path)
                    .offset(offset)
                    .length(Length::Exact(len))
                    .build()
                    .await
                    .map_err(|e| {
                        ObjectError::Other(ObjectFault::new(
                            "UploadPart",
                            format!("reading the file to upload: {}", DisplayErrorContext(&e)),
                        ))
                    })?;
                let sent = self
                    .client
                    .upload_part()
                    .bucket(&self.bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .part_number(number)
                    .content_length(i64::try_from(len).unwrap_or(i64::MAX))
                    .body(body)
                    .send()
                    .await
                    .map_err(|err| sdk_error("UploadPart", &err))?;
                Ok(sent.e_tag().map(str::to_owned))
            })
            .await?;
            parts.push(
                CompletedPart::builder()
                    .part_number(number)
                    .set_e_tag(e_tag)
                    .build(),
            );
            offset += len;
            number += 1;
        }
        let upload = CompletedMultipartUpload::builder()
            .set_parts(Some(parts))
            .build();
        with_retries(self.backoff, "CompleteMultipartUpload", || async {
            let sent = self
                .client
                .complete_multipart_upload()
                .bucket(&self.bucket)
                .key(key)
                .upload_id(upload_id)
                .multipart_upload(upload.clone())
                .if_none_match("*")
                .send()
                .await;
            created_unless_exists("CompleteMultipartUpload", sent)
        })
        .await
    }

    /// Starts reading the object under `key`: its body and announced size, refused when it
    /// announces more than `max_size` (the readers also count what arrives).
    async fn open_capped(
        &self,
        key: &str,
        max_size: u64,
    ) -> Result<(ByteStream, Option<u64>), ObjectError> {
        let output = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(|err| sdk_error("GetObject", &err))?;
        let announced = output.content_length().map(i64_to_u64);
        if let Some(size) = announced
            && size > max_size
        {
            return Err(ObjectError::TooLarge {
                size,
                limit: max_size,
            });
        }
        Ok((output.body, announced))
    }

    /// Downloads the object under `key` into a new file at `path` (mode 0600), refusing
    /// objects larger than `max_size`; memory stays bounded whatever its size. A retried
    /// download starts the file over. Returns the bytes written. The file is not synced to
    /// the disk: it is for reading back, not for surviving a crash.
    pub async fn get_to_file(
        &self,
        key: &str,
        path: &Path,
        max_size: u64,
    ) -> Result<u64, ObjectError> {
        with_retries(self.backoff, "GetObject", || async {
            let (body, announced) = self.open_capped(key, max_size).await?;
            let write_err =
                |e: std::io::Error| local("GetObject", "writing the downloaded file", &e);
            let mut file = tokio::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)
                .await
                .map_err(write_err)?;
            let mut body = body;
            let mut total = 0u64;
            loop {
                match body.try_next().await {
                    Ok(Some(chunk)) => {
                        total += chunk.len() as u64;
                        if total > max_size {
                            return Err(ObjectError::TooLarge {
                                size: announced.unwrap_or(total).max(total),
                                limit: max_size,
                            });
                        }
                        file.write_all(&chunk).await.map_err(write_err)?;
                    }
                    Ok(None) => break,
                    Err(err) => {
                        return Err(ObjectError::Transient(ObjectFault::new(
                            "GetObject",
                            format!("reading the body failed: {}", DisplayErrorContext(&err)),
                        )));
                    }
                }
            }
            // Flushed to the page cache, not synced to the disk: the file is scratch the
            // caller reads back at once and removes, and a sync is a disk write an apply
            // would wait on (0.25 ms on a quiet ext4 virtual disk, 3.7 ms while another
            // process writes to it).
            file.flush().await.map_err(write_err)?;
            Ok(total)
        })
        .await
    }

    /// Writes `body` under `key`, replacing any existing object. Production paths use
    /// [`ObjectStore::put_if_absent`]; this exists for tests and repairs.
    pub async fn put(&self, key: &str, body: Vec<u8>) -> Result<(), ObjectError> {
        let body = Bytes::from(body);
        with_retries(self.backoff, "PutObject", || async {
            self.client
                .put_object()
                .bucket(&self.bucket)
                .key(key)
                .body(ByteStream::from(body.clone()))
                .send()
                .await
                .map(|_| ())
                .map_err(|err| sdk_error("PutObject", &err))
        })
        .await
    }

    /// Reads the object under `key`, refusing objects larger than `max_size` bytes.
    ///
    /// The size is checked with a HEAD request before the body is fetched, and again while
    /// reading (the object may be replaced in between), so no more than `max_size` bytes
    /// (plus one chunk) are ever read.
    pub async fn get(&self, key: &str, max_size: u64) -> Result<Vec<u8>, ObjectError> {
        with_retries(self.backoff, "GetObject", || async {
            let head = self
                .client
                .head_object()
                .bucket(&self.bucket)
                .key(key)
                .send()
                .await
                .map_err(|err| sdk_error("HeadObject", &err))?;
            if let Some(size) = head.content_length().map(i64_to_u64)
                && size > max_size
            {
                return Err(ObjectError::TooLarge {
                    size,
                    limit: max_size,
                });
            }

            let (body, announced) = self.open_capped(key, max_size).await?;
            read_capped(body, announced, max_size).await
        })
        .await
    }

    /// Deletes the object under `key`; a missing object is success.
    pub async fn delete(&self, key: &str) -> Result<(), ObjectError> {
        with_retries(self.backoff, "DeleteObject", || async {
            match self
                .client
                .delete_object()
                .bucket(&self.bucket)
                .key(key)
                .send()
                .await
            {
                Ok(_) => Ok(()),
                Err(err) => match sdk_error("DeleteObject", &err) {
                    ObjectError::NotFound => Ok(()),
                    other => Err(other),
                },
            }
        })
        .await
    }

    /// Whether an object exists under `key`.
    pub async fn exists(&self, key: &str) -> Result<bool, ObjectError> {
        with_retries(self.backoff, "HeadObject", || async {
            match self
                .client
                .head_object()
                .bucket(&self.bucket)
                .key(key)
                .send()
                .await
            {
                Ok(_) => Ok(true),
                Err(err) => match sdk_error("HeadObject", &err) {
                    ObjectError::NotFound => Ok(false),
                    other => Err(other),
                },
            }
        })
        .await
    }

    /// The keys of all objects whose key starts with `prefix`, in the store's order
    /// (lexicographic on S3). Follows continuation tokens; each page is retried on its own.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, ObjectError> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = with_retries(self.backoff, "ListObjectsV2", || async {
                self.client
                    .list_objects_v2()
                    .bucket(&self.bucket)
                    .prefix(prefix)
                    .set_continuation_token(token.clone())
                    .send()
                    .await
                    .map_err(|err| sdk_error("ListObjectsV2", &err))
            })
            .await?;
            keys.extend(
                page.contents()
                    .iter()
                    .filter_map(|object| object.key())
                    .map(str::to_owned),
            );
            match (page.is_truncated(), page.next_continuation_token()) {
                (Some(true), Some(next)) if !next.is_empty() && token.as_deref() != Some(next) => {
                    token = Some(next.to_owned());
                }
                (Some(true), _) => {
                    return Err(ObjectError::Other(ObjectFault::new(
                        "ListObjectsV2",
                        "listing is truncated but has no new continuation token",
                    )));
                }
                _ => return Ok(keys),
            }
        }
    }

    /// The same client working in `bucket` instead (a maintenance task walking buckets).
    pub fn in_bucket(&self, bucket: &str) -> Self {
        Self {
            bucket: bucket.to_owned(),
            ..self.clone()
        }
    }

    /// The names of every bucket the credentials own whose name starts with `prefix`
    /// (a maintenance task's listing; the pipeline works in one bucket and never lists).
    pub async fn list_buckets(&self, prefix: &str) -> Result<Vec<String>, ObjectError> {
        let page = with_retries(self.backoff, "ListBuckets", || async {
            self.client
                .list_buckets()
                .send()
                .await
                .map_err(|err| sdk_error("ListBuckets", &err))
        })
        .await?;
        Ok(page
            .buckets()
            .iter()
            .filter_map(|bucket| bucket.name())
            .filter(|name| name.starts_with(prefix))
            .map(str::to_owned)
            .collect())
    }

    /// Deletes this store's bucket and every object in it (S3 deletes only an empty
    /// bucket, so the objects go first, one by one); a missing bucket is success.
    pub async fn delete_bucket(&self) -> Result<(), ObjectError> {
        let keys = match self.list("").await {
            Ok(keys) => keys,
            Err(ObjectError::Other(fault)) if fault.code() == Some("NoSuchBucket") => {
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        for key in keys {
            self.delete(&key).await?;
        }
        with_retries(self.backoff, "DeleteBucket", || async {
            match self
                .client
                .delete_bucket()
                .bucket(&self.bucket)
                .send()
                .await
            {
                Ok(_) => Ok(()),
                Err(err) => {
                    let (class, fault) = classify("DeleteBucket", &err);
                    match (&class, fault.code()) {
                        (Class::NotFound, _) | (_, Some("NoSuchBucket")) => Ok(()),
                        _ => Err(to_error(class, fault)),
                    }
                }
            }
        })
        .await
    }
}

/// A local file could not be read or written (named by what it was for, never its path).
fn local(operation: &'static str, what: &str, e: &std::io::Error) -> ObjectError {
    let fault = ObjectFault::new(operation, format!("{what}: {}", e.kind()));
    match e.kind() {
        std::io::ErrorKind::Interrupted | std::io::ErrorKind::StorageFull => {
            ObjectError::Transient(fault)
        }
        _ => ObjectError::Other(fault),
    }
}

/// Reads a body, failing with `TooLarge` as soon as more than `limit` bytes arrive.
async fn read_capped(
    mut body: ByteStream,
    announced: Option<u64>,
    limit: u64,
) -> Result<Vec<u8>, ObjectError> {
    let capacity = announced.unwrap_or(0).min(limit);
    let mut out = Vec::with_capacity(usize::try_from(capacity).unwrap_or(0));
    loop {
        match body.try_next().await {
            Ok(Some(chunk)) => {
                let total = out.len() as u64 + chunk.len() as u64;
                if total > limit {
                    return Err(ObjectError::TooLarge {
                        size: announced.unwrap_or(total).max(total),
                        limit,
                    });
                }
                out.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(out),
            Err(err) => {
                return Err(ObjectError::Transient(ObjectFault::new(
                    "GetObject",
                    format!("reading the body failed: {}", DisplayErrorContext(&err)),
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_s3::error::{ConnectorError, ErrorMetadata};
    use aws_sdk_s3::operation::put_object::PutObjectError;
    use aws_sdk_s3::primitives::SdkBody;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const CANARY: &str = "canary-secret-9f3e2a";

    fn config() -> ObjectStoreConfig {
        ObjectStoreConfig {
            endpoint: Some("http://127.0.0.1:9".to_owned()),
            region: "us-east-1".to_owned(),
            access_key: "AKIDTEST".to_owned(),
            secret_key: Secret::new(CANARY.to_owned()),
            bucket: "takosumi-test".to_owned(),
            timeouts: ObjectTimeouts::default(),
        }
    }

    fn service_error(status: u16, code: Option<&str>) -> SdkError<PutObjectError, HttpResponse> {
        let mut meta = ErrorMetadata::builder().message("server said no");
        if let Some(code) = code {
            meta = meta.code(code);
        }
        SdkError::service_error(
            PutObjectError::generic(meta.build()),
            HttpResponse::new(status.try_into().unwrap(), SdkBody::empty()),
        )
    }

    fn fast_backoff() -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(1))
            .with_max_delay(Duration::from_millis(2))
            .with_max_times(4)
    }

    #[test]
    fn config_debug_redacts_secret() {
        let cfg = config();
        let text = format!("{cfg:?} {cfg:#?}");
        assert!(!text.contains(CANARY), "{text}");
        assert!(text.contains("AKIDTEST"));
    }

    #[tokio::test]
    async fn connect_builds_without_network_and_debug_redacts() {
        let store = ObjectStore::connect(&config()).await;
        assert_eq!(store.bucket(), "takosumi-test");
        let text = format!("{store:?} {:?}", store.clone());
        assert!(!text.contains(CANARY), "{text}");

        let mut no_endpoint = config();
        no_endpoint.endpoint = None;
        no_endpoint.region = "eu-west-1".to_owned();
        let store = ObjectStore::connect(&no_endpoint).await;
        assert_eq!(store.bucket(), "takosumi-test");
    }

    #[tokio::test]
    async fn connection_refused_is_transient_and_never_shows_secret() {
        // Port 9 (discard) on localhost is closed on any sane test machine.
        let mut store = ObjectStore::connect(&config()).await;
        store.backoff = fast_backoff();
        let err = store.exists("plans/run_x/plan").await.unwrap_err();
        assert!(err.retryable(), "{err:?}");
        let mut chain = format!("{err} {err:?}");
        let mut source = std::error::Error::source(&err);
        while let Some(s) = source {
            chain.push_str(&format!(" | {s}"));
            source = s.source();
        }
        assert!(!chain.contains(CANARY), "{chain}");
        assert!(!chain.contains("plans/run_x"), "object key leaked: {chain}");
    }

    #[test]
    fn status_classification() {
        assert_eq!(classify_status(500, None), Class::Transient);
        assert_eq!(classify_status(502, Some("BadGateway")), Class::Transient);
        assert_eq!(classify_status(503, Some("SlowDown")), Class::Transient);
        assert_eq!(classify_status(429, None), Class::Transient);
        assert_eq!(classify_status(408, None), Class::Transient);
        assert_eq!(
            classify_status(400, Some("RequestTimeout")),
            Class::Transient
        );
        assert_eq!(classify_status(400, Some("Throttling")), Class::Transient);
        assert_eq!(classify_status(403, Some("AccessDenied")), Class::Denied);
        assert_eq!(
            classify_status(403, Some("SignatureDoesNotMatch")),
            Class::Denied
        );
        assert_eq!(classify_status(401, None), Class::Denied);
        assert_eq!(
            classify_status(412, Some("PreconditionFailed")),
            Class::Precondition
        );
        assert_eq!(
            classify_status(409, Some("ConditionalRequestConflict")),
            Class::Precondition
        );
        assert_eq!(
            classify_status(409, Some("BucketAlreadyOwnedByYou")),
            Class::Other
        );
        assert_eq!(classify_status(404, Some("NoSuchKey")), Class::NotFound);
        assert_eq!(classify_status(404, None), Class::NotFound);
        assert_eq!(classify_status(404, Some("NoSuchBucket")), Class::Other);
        assert_eq!(classify_status(400, Some("InvalidArgument")), Class::Other);
    }

    #[test]
    fn sdk_error_classification() {
        let (class, fault) = classify("PutObject", &service_error(503, Some("SlowDown")));
        assert_eq!(class, Class::Transient);
        assert_eq!(fault.status(), Some(503));
        assert_eq!(fault.code(), Some("SlowDown"));
        assert_eq!(fault.operation(), "PutObject");
        assert_eq!(
            fault.to_string(),
            "PutObject failed with HTTP 503 (SlowDown): server said no"
        );

        let err = sdk_error("PutObject", &service_error(412, Some("PreconditionFailed")));
        assert!(matches!(err, ObjectError::Other(_)) && !err.retryable());
        let err = sdk_error("PutObject", &service_error(403, Some("AccessDenied")));
        assert!(matches!(err, ObjectError::Denied(_)) && !err.retryable());
        let err = sdk_error("PutObject", &service_error(404, None));
        assert!(matches!(err, ObjectError::NotFound));

        let timeout: SdkError<PutObjectError, HttpResponse> =
            SdkError::timeout_error("attempt timed out");
        assert!(sdk_error("PutObject", &timeout).retryable());

        let io: SdkError<PutObjectError, HttpResponse> =
            SdkError::dispatch_failure(ConnectorError::io(Box::new(std::io::Error::from(
                std::io::ErrorKind::ConnectionReset,
            ))));
        assert!(sdk_error("PutObject", &io).retryable());

        let user: SdkError<PutObjectError, HttpResponse> =
            SdkError::dispatch_failure(ConnectorError::user("bad request body".into()));
        assert!(matches!(
            sdk_error("PutObject", &user),
            ObjectError::Other(_)
        ));

        let construction: SdkError<PutObjectError, HttpResponse> =
            SdkError::construction_failure("missing bucket");
        assert!(!sdk_error("PutObject", &construction).retryable());
    }

    #[test]
    fn error_display() {
        let err = ObjectError::TooLarge {
            size: 20 * 1024 * 1024,
            limit: 19 * 1024 * 1024,
        };
        assert_eq!(
            err.to_string(),
            "object is 20971520 bytes, over the limit of 19922944 bytes"
        );
        assert!(!err.retryable());
        assert!(!ObjectError::NotFound.retryable());
        let err = sdk_error("GetObject", &service_error(500, Some("InternalError")));
        assert_eq!(
            err.to_string(),
            "object storage temporarily failed in GetObject"
        );
        let source = std::error::Error::source(&err).map(ToString::to_string);
        assert_eq!(
            source.as_deref(),
            Some("GetObject failed with HTTP 500 (InternalError): server said no")
        );
    }

    #[tokio::test]
    async fn transient_errors_are_retried_five_times() {
        let calls = AtomicUsize::new(0);
        let result: Result<(), ObjectError> = with_retries(fast_backoff(), "PutObject", || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(sdk_error("PutObject", &service_error(503, None)))
        })
        .await;
        assert!(result.unwrap_err().retryable());
        assert_eq!(calls.load(Ordering::SeqCst), 5);
    }

    #[tokio::test]
    async fn transient_then_success() {
        let calls = AtomicUsize::new(0);
        let result = with_retries(fast_backoff(), "PutObject", || async {
            if calls.fetch_add(1, Ordering::SeqCst) < 2 {
                Err(sdk_error("PutObject", &service_error(500, None)))
            } else {
                Ok(7)
            }
        })
        .await;
        assert_eq!(result.unwrap(), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn client_errors_are_not_retried() {
        for (status, code) in [
            (403, "AccessDenied"),
            (400, "InvalidArgument"),
            (404, "NoSuchKey"),
        ] {
            let calls = AtomicUsize::new(0);
            let result: Result<(), ObjectError> =
                with_retries(fast_backoff(), "GetObject", || async {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Err(sdk_error("GetObject", &service_error(status, Some(code))))
                })
                .await;
            assert!(!result.unwrap_err().retryable());
            assert_eq!(calls.load(Ordering::SeqCst), 1, "{status} {code}");
        }
    }

    #[tokio::test]
    async fn read_capped_stops_at_limit() {
        let body = ByteStream::from(vec![1u8; 100]);
        assert_eq!(read_capped(body, Some(100), 100).await.unwrap().len(), 100);

        let body = ByteStream::from(vec![1u8; 101]);
        let err = read_capped(body, None, 100).await.unwrap_err();
        assert!(
            matches!(
                err,
                ObjectError::TooLarge {
                    size: 101,
                    limit: 100
                }
            ),
            "{err:?}"
        );

        // The server understated the length: still capped.
        let body = ByteStream::from(vec![1u8; 50]);
        let err = read_capped(body, Some(10), 20).await.unwrap_err();
        assert!(
            matches!(err, ObjectError::TooLarge { limit: 20, .. }),
            "{err:?}"
        );

        let body = ByteStream::from(Vec::new());
        assert!(read_capped(body, Some(0), 0).await.unwrap().is_empty());
    }
}
