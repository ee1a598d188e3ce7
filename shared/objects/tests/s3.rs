//! Integration tests against a real S3-protocol server (s3s-fs in the local stack).
//!
//! Skipped (with a message) unless `TAKOSUMI_S3_ENDPOINT` is set. Also reads
//! `TAKOSUMI_S3_ACCESS_KEY`, `TAKOSUMI_S3_SECRET_KEY` and `TAKOSUMI_S3_REGION`
//! (default `us-east-1`). Each test works in its own fresh bucket.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use takosumi_core::Secret;
use takosumi_objects::{ObjectError, ObjectStore, ObjectStoreConfig, ObjectTimeouts, PutOutcome};

fn random_hex() -> String {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// A store on a fresh bucket, or `None` (test skipped) when no server is configured.
async fn store(test: &str) -> Option<ObjectStore> {
    let Ok(endpoint) = std::env::var("TAKOSUMI_S3_ENDPOINT") else {
        eprintln!("skipping {test}: TAKOSUMI_S3_ENDPOINT is not set");
        return None;
    };
    let cfg = ObjectStoreConfig {
        endpoint: Some(endpoint),
        region: std::env::var("TAKOSUMI_S3_REGION").unwrap_or_else(|_| "us-east-1".to_owned()),
        access_key: std::env::var("TAKOSUMI_S3_ACCESS_KEY").unwrap_or_default(),
        secret_key: Secret::new(std::env::var("TAKOSUMI_S3_SECRET_KEY").unwrap_or_default()),
        bucket: format!("t-objects-{}", random_hex()),
        timeouts: ObjectTimeouts::default(),
    };
    let store = ObjectStore::connect(&cfg).await;
    store.ensure_bucket().await.expect("create bucket");
    // A second call finds the bucket and succeeds.
    store.ensure_bucket().await.expect("ensure existing bucket");
    Some(store)
}

#[tokio::test]
async fn put_if_absent_is_create_only() {
    let Some(s) = store("put_if_absent_is_create_only").await else {
        return;
    };
    let key = "runs/run_a/plan.sealed";
    assert_eq!(
        s.put_if_absent(key, b"first".to_vec()).await.unwrap(),
        PutOutcome::Created
    );
    assert_eq!(
        s.put_if_absent(key, b"second".to_vec()).await.unwrap(),
        PutOutcome::AlreadyExists
    );
    assert_eq!(s.get(key, 1024).await.unwrap(), b"first");

    // put overwrites.
    s.put(key, b"tampered".to_vec()).await.unwrap();
    assert_eq!(s.get(key, 1024).await.unwrap(), b"tampered");
    s.delete_bucket().await.unwrap();
}

#[tokio::test]
async fn get_round_trip_and_limits() {
    let Some(s) = store("get_round_trip_and_limits").await else {
        return;
    };
    let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    s.put_if_absent("a/big", body.clone()).await.unwrap();
    assert_eq!(s.get("a/big", body.len() as u64).await.unwrap(), body);

    match s.get("a/big", 1000).await {
        Err(ObjectError::TooLarge { size, limit }) => {
            assert_eq!(size, body.len() as u64);
            assert_eq!(limit, 1000);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }

    // An empty object is a present, empty byte sequence.
    s.put_if_absent("a/empty", Vec::new()).await.unwrap();
    assert!(s.get("a/empty", 0).await.unwrap().is_empty());
    assert!(s.exists("a/empty").await.unwrap());

    assert!(matches!(
        s.get("a/missing", 10).await,
        Err(ObjectError::NotFound)
    ));
    assert!(!s.exists("a/missing").await.unwrap());
    s.delete_bucket().await.unwrap();
}

#[tokio::test]
async fn delete_and_list() {
    let Some(s) = store("delete_and_list").await else {
        return;
    };
    for key in ["runs/r1/plan", "runs/r1/lock", "runs/r2/plan", "other/x"] {
        s.put_if_absent(key, key.as_bytes().to_vec()).await.unwrap();
    }
    let mut r1 = s.list("runs/r1/").await.unwrap();
    r1.sort();
    assert_eq!(r1, ["runs/r1/lock", "runs/r1/plan"]);
    let mut runs = s.list("runs/").await.unwrap();
    runs.sort();
    assert_eq!(runs, ["runs/r1/lock", "runs/r1/plan", "runs/r2/plan"]);
    assert!(s.list("nothing/").await.unwrap().is_empty());

    s.delete("runs/r1/plan").await.unwrap();
    assert!(!s.exists("runs/r1/plan").await.unwrap());
    assert!(matches!(
        s.get("runs/r1/plan", 100).await,
        Err(ObjectError::NotFound)
    ));
    // Deleting a missing object is fine.
    s.delete("runs/r1/plan").await.unwrap();
    assert_eq!(s.list("runs/r1/").await.unwrap(), ["runs/r1/lock"]);
    s.delete_bucket().await.unwrap();
}

/// Buckets are listed by prefix and one is deleted with its objects; deleting it again is fine,
/// and the same client works in another bucket.
#[tokio::test]
async fn buckets_listed_and_deleted() {
    let Some(s) = store("buckets_listed_and_deleted").await else {
        return;
    };
    let name = s.bucket().to_owned();
    s.put("k", b"x".to_vec()).await.unwrap();
    let listed = s.list_buckets("t-objects-").await.unwrap();
    assert!(listed.contains(&name), "{name} not in {listed:?}");
    assert!(
        listed.iter().all(|b| b.starts_with("t-objects-")),
        "{listed:?}"
    );
    assert!(
        !s.list_buckets(&format!("{name}-no"))
            .await
            .unwrap()
            .contains(&name)
    );

    let other = s.in_bucket(&format!("{name}-b"));
    other.ensure_bucket().await.unwrap();
    assert_eq!(other.bucket(), format!("{name}-b"));
    assert!(
        other.list("").await.unwrap().is_empty(),
        "another bucket's keys"
    );
    assert_eq!(s.list("").await.unwrap(), ["k"]);

    for bucket in [&other, &s] {
        bucket.delete_bucket().await.unwrap();
        assert!(
            !s.list_buckets(bucket.bucket())
                .await
                .unwrap()
                .contains(&bucket.bucket().to_owned())
        );
        // Deleting a missing bucket is fine.
        bucket.delete_bucket().await.unwrap();
    }
}

#[tokio::test]
async fn list_paginates() {
    let Some(s) = store("list_paginates").await else {
        return;
    };
    // More than one default page (1000 keys).
    let n = 1105;
    for i in 0..n {
        s.put(&format!("p/{i:05}"), vec![1]).await.unwrap();
    }
    let keys = s.list("p/").await.unwrap();
    assert_eq!(keys.len(), n);
    let mut sorted = keys.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), n);
    s.delete_bucket().await.unwrap();
}

#[tokio::test]
async fn wrong_secret_is_denied() {
    let Ok(endpoint) = std::env::var("TAKOSUMI_S3_ENDPOINT") else {
        eprintln!("skipping wrong_secret_is_denied: TAKOSUMI_S3_ENDPOINT is not set");
        return;
    };
    let canary = "wrong-secret-canary-51c7";
    let cfg = ObjectStoreConfig {
        endpoint: Some(endpoint),
        region: std::env::var("TAKOSUMI_S3_REGION").unwrap_or_else(|_| "us-east-1".to_owned()),
        access_key: std::env::var("TAKOSUMI_S3_ACCESS_KEY").unwrap_or_default(),
        secret_key: Secret::new(canary.to_owned()),
        bucket: format!("t-objects-{}", random_hex()),
        timeouts: ObjectTimeouts::default(),
    };
    let s = ObjectStore::connect(&cfg).await;
    let err = s.put("k", b"x".to_vec()).await.unwrap_err();
    assert!(matches!(err, ObjectError::Denied(_)), "{err:?}");
    assert!(!err.retryable());
    let mut text = format!("{err} {err:?}");
    if let Some(source) = std::error::Error::source(&err) {
        text.push_str(&source.to_string());
    }
    assert!(!text.contains(canary), "{text}");
}

/// Files go up part by part and come down to a file: a file over one part is a multipart
/// upload that is still create-only, and both ways keep every byte.
#[tokio::test]
async fn files_stream_up_in_parts_and_down_whole() {
    let Some(s) = store("files_stream_up_in_parts_and_down_whole").await else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("t-objects-{}", random_hex()));
    std::fs::create_dir_all(&dir).unwrap();
    for size in [
        10u64,
        takosumi_objects::PART_LEN,
        2 * takosumi_objects::PART_LEN + 5,
    ] {
        let body: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        let up = dir.join(format!("up-{size}"));
        std::fs::write(&up, &body).unwrap();
        let key = format!("files/{size}");
        assert_eq!(
            s.put_file_if_absent(&key, &up).await.unwrap(),
            PutOutcome::Created,
            "{size}"
        );
        let other = dir.join(format!("other-{size}"));
        std::fs::write(&other, b"someone else").unwrap();
        std::fs::write(&up, vec![0u8; body.len()]).unwrap();
        assert_eq!(
            s.put_file_if_absent(&key, &up).await.unwrap(),
            PutOutcome::AlreadyExists,
            "{size}: a second upload never replaces the first"
        );
        let down = dir.join(format!("down-{size}"));
        assert_eq!(s.get_to_file(&key, &down, size).await.unwrap(), size);
        assert!(
            std::fs::read(&down).unwrap() == body,
            "{size}: bytes differ"
        );
        if size > 10 {
            assert!(matches!(
                s.get_to_file(&key, &down, size - 1).await,
                Err(ObjectError::TooLarge { .. })
            ));
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    s.delete_bucket().await.unwrap();
}
