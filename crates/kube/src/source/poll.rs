//! The labelled trust of the tenant namespaces past the watches'
//! connections, listed again on a pace instead of watched.
//!
//! kube-apiserver serves at most 100 streams on one HTTP/2 connection
//! unless its `--http2-max-streams-per-connection` says otherwise, and a
//! watch holds one stream for as long as it runs: one watch per tenant
//! namespace cannot stay within a fixed number of connections whatever the
//! tenant count. Past `kubernetes.max_api_connections`' worth of watches,
//! a namespace's labelled Secrets or ConfigMaps are listed again (from the
//! API server's watch cache, `resourceVersion=0`) at least
//! [`EVERY_AT_LEAST`] apart, and all such lists of a replica together at
//! most [`PER_SECOND`] a second: a change there is seen within
//! `max(10 s, polled / 20)` seconds instead of at once. A list that finds
//! what the last one found wakes no pass. kube-runtime has no such
//! stream; this one yields the same events a watch's first list does, so
//! the store, the errors and the waits are a watch's.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use kube::Resource;

/// How many lists a second all polled namespaces of a replica take at
/// most: the load on the API server stays bounded whatever the tenant
/// count (a labelled list from the watch cache costs it little).
pub(super) const PER_SECOND: u32 = 20;

/// How long a polled namespace waits at least between two lists.
pub(super) const EVERY_AT_LEAST: Duration = Duration::from_secs(10);

/// How many first lists (of namespaces newly listed on the pace) are
/// made at once: not paced (a watch's first list is not either), but
/// bounded, so that a replica starting with thousands of them leaves
/// room on the main connection for its lease and status.
const FIRST_AT_ONCE: usize = 16;

/// The turns of the polled namespaces' lists, [`PER_SECOND`] a second,
/// shared by all of them, and the first lists' bound.
#[derive(Clone)]
pub(super) struct Pace(
    Arc<Mutex<Option<tokio::time::Instant>>>,
    Arc<tokio::sync::Semaphore>,
);

impl Default for Pace {
    fn default() -> Pace {
        Pace(
            Arc::default(),
            Arc::new(tokio::sync::Semaphore::new(FIRST_AT_ONCE)),
        )
    }
}

impl Pace {
    /// Until this caller's turn, the next free one.
    async fn turn(&self) {
        let at = {
            let mut next = seedlink_net::sync::lock(&self.0, "trust list pace");
            let now = tokio::time::Instant::now();
            let at = next.map_or(now, |n| n.max(now));
            *next = Some(at + Duration::from_secs(1) / PER_SECOND);
            at
        };
        tokio::time::sleep_until(at).await;
    }
}

/// What a list found: each object's name and resourceVersion, sorted.
type Seen = Vec<(Option<String>, Option<String>)>;

/// One polled namespace's state between lists: what the last list found,
/// and its resourceVersion (`None` before the first list).
type Polled<K> = (Api<K>, String, Pace, Option<Seen>, Option<String>);

/// The objects `api` holds with label `selector`: listed at once (within
/// [`FIRST_AT_ONCE`]), then again on `pace`, each time no older than the
/// last list (a lagging watch cache never takes the objects back in time,
/// as to a CA revoked since); each list that differs from the last yields
/// a watch's list events (`Init`, `InitApply` each, `InitDone`), each
/// failure a list error (retried at the next turn).
pub(super) fn listed_on_pace<K>(
    api: Api<K>,
    selector: String,
    pace: Pace,
) -> impl futures_util::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let state: Polled<K> = (api, selector, pace, None, None);
    futures_util::stream::unfold(state, next_list).flat_map(futures_util::stream::iter)
}

/// The events of the next list that differs from the last one (or fails).
async fn next_list<K>(
    (api, selector, pace, mut last, mut version): Polled<K>,
) -> Option<(Vec<Result<watcher::Event<K>, watcher::Error>>, Polled<K>)>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    loop {
        let params = ListParams::default().labels(&selector);
        let listed = match &version {
            Some(v) => {
                tokio::time::sleep(EVERY_AT_LEAST).await;
                pace.turn().await;
                let params = params.at(v).matching(kube::api::VersionMatch::NotOlderThan);
                api.list(&params).await
            }
            None => {
                let _permit = pace.1.clone().acquire_owned().await.ok();
                api.list(&params.match_any()).await
            }
        };
        let list = match listed {
            Ok(list) => list,
            Err(e) => {
                // The next attempt waits its turn on the pace.
                version.get_or_insert_with(|| "0".into());
                let failed = vec![Err(watcher::Error::InitialListFailed(e))];
                return Some((failed, (api, selector, pace, last, version)));
            }
        };
        version = list.metadata.resource_version.clone().or(version);
        let mut seen: Seen = list
            .items
            .iter()
            .map(|o| (o.meta().name.clone(), o.meta().resource_version.clone()))
            .collect();
        seen.sort();
        if last.as_ref() == Some(&seen) {
            continue;
        }
        last = Some(seen);
        let objects = list.items.into_iter().map(|mut o| {
            // As a watch keeps them (`watches::reflected`).
            let meta = o.meta_mut();
            meta.managed_fields = None;
            meta.annotations = None;
            Ok(watcher::Event::InitApply(o))
        });
        let events = std::iter::once(Ok(watcher::Event::Init))
            .chain(objects)
            .chain(std::iter::once(Ok(watcher::Event::InitDone)))
            .collect();
        return Some((events, (api, selector, pace, last, version)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Turns are spread [`PER_SECOND`] a second whoever asks, and one
    /// asked after a quiet while is given at once (time paused).
    #[tokio::test(start_paused = true)]
    async fn turns_are_spread_over_the_second() {
        let pace = Pace::default();
        let start = tokio::time::Instant::now();
        for _ in 0..PER_SECOND {
            pace.turn().await;
        }
        let step = Duration::from_secs(1) / PER_SECOND;
        assert_eq!(start.elapsed(), step * (PER_SECOND - 1));
        tokio::time::sleep(Duration::from_secs(5)).await;
        let asked = tokio::time::Instant::now();
        pace.turn().await;
        assert_eq!(asked.elapsed(), Duration::ZERO);
    }
}
