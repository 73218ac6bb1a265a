//! `seedlink node-proxy`: runs on every shoot node (host network), listens
//! on the advertised kube-apiserver address and carries each connection to
//! the seed's gateway: HTTP/1.1 CONNECT with the destination header
//! (GEP-30), HTTP/2 CONNECT streams on one shared connection (Kubermatic's
//! strategy), or, in legacy mode, a PROXY protocol header (GEP-08).
//!
//! Nothing the client sends is forwarded before the gateway's `200`.

pub mod admin;
pub mod config;
pub mod health;
pub mod netif;
pub mod proxy;
pub mod tunnel;

pub use proxy::{Metrics, Mode, NodeProxy, Options, OutcomeLabels, ResultLabels};
/// A corporate egress proxy: connections to the gateway are opened with
/// `CONNECT <gateway> HTTP/1.1` through it (HyperShift's
/// `kubernetes-default-proxy` does the same).
pub use seedlink_net::egress::EgressProxy;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

impl NodeProxy {
    /// Accepts on `listener` until draining, and probes the gateway.
    pub fn serve(
        self: &Arc<Self>,
        listener: TcpListener,
        admin: TcpListener,
        access: seedlink_net::admin::Access,
    ) {
        let np = self.clone();
        tokio::spawn(async move {
            let stop = np.lifecycle.stop_accepting.clone();
            seedlink_net::accept::accept_loop(&listener, &stop, |stream, peer| {
                np.accept(stream, peer)
            })
            .await;
        });
        let np = self.clone();
        tokio::spawn(async move { health::run(&np).await });
        let np = self.clone();
        tokio::spawn(async move { admin::serve(np, admin, access).await });
        self.lifecycle.serving();
    }

    fn accept(self: &Arc<Self>, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            self.count("refused_max_connections");
            drop(stream);
            return;
        };
        let np = self.clone();
        self.lifecycle.tasks.spawn(async move {
            np.metrics.active.inc();
            let outcome = tokio::select! {
                o = tunnel::carry(&np, stream, peer) => o,
                () = np.lifecycle.close_all.cancelled() => tunnel::Outcome::ClosedDrain,
            };
            np.metrics.active.dec();
            np.count(outcome.reason());
            drop(permit);
        });
    }

    /// Keeps `iface` in place: checks now, then every `every`; readiness
    /// follows the result. Returns the first check's result, so a start-up
    /// failure (e.g. no `dummy` support) is reported at once.
    pub async fn manage_interface(
        self: &Arc<Self>,
        iface: netif::Interface,
        every: Duration,
    ) -> Result<(), netif::NetifError> {
        netif::ensure(&iface).await?;
        self.address_ok.store(true, Ordering::Release);
        let np = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    () = np.lifecycle.close_all.cancelled() => return,
                }
                np.reassert(&iface).await;
            }
        });
        Ok(())
    }

    /// Puts the advertised address back if it went missing, and records
    /// whether the node-proxy still has it.
    async fn reassert(&self, iface: &netif::Interface) {
        match netif::ensure(iface).await {
            Ok(changed) => {
                if changed {
                    tracing::warn!(address = %iface.address, link = %iface.name, "address was missing; put back");
                    self.metrics.address_reasserted.inc();
                }
                self.address_ok.store(true, Ordering::Release);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot keep the advertised address");
                self.address_ok.store(false, Ordering::Release);
            }
        }
    }

    /// Drains: not ready, stop accepting, wait, close the rest.
    pub async fn drain(&self) -> usize {
        self.lifecycle.drain(self.opts.drain).await
    }
}
