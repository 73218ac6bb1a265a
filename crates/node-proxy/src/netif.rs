//! Puts the advertised kube-apiserver address on a dedicated interface,
//! over rtnetlink (no shelling out), and keeps it there.
//!
//! Like Gardener's apiserver-proxy sidecar: create the link if missing and
//! bring it up, remove the address from every other link (it must not stay
//! on `lo`, where Cilium ignores it and it becomes the node's source
//! address), add it as /32 or /128. Kernels without the `dummy` link type
//! (this machine's) can use a port-less `bridge`, or an existing link.

use std::net::IpAddr;

use futures_util::TryStreamExt;
use rtnetlink::packet_route::address::AddressMessage;
use rtnetlink::{Handle, LinkBridge, LinkDummy, LinkUnspec};

/// Which link carries the address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    /// Create a `dummy` link if missing (what Gardener does).
    Dummy,
    /// Create a port-less `bridge` if missing (for kernels without `dummy`).
    Bridge,
    /// Use a link that must already exist.
    Existing,
}

/// The interface and address to maintain.
#[derive(Debug, Clone)]
pub struct Interface {
    /// Link name, e.g. `apiserver-proxy`.
    pub name: String,
    /// How the link comes to exist.
    pub kind: LinkKind,
    /// The advertised address.
    pub address: IpAddr,
}

/// Why the address could not be put in place.
#[derive(Debug, thiserror::Error)]
pub enum NetifError {
    /// No netlink socket.
    #[error("cannot open a netlink socket: {0}")]
    Socket(#[from] std::io::Error),
    /// `--link-kind existing` and the link is missing.
    #[error("interface {0:?} does not exist (--link-kind existing)")]
    Missing(String),
    /// The kernel cannot create `dummy` links.
    #[error("cannot create dummy interface {0:?}: the kernel has no 'dummy' link type ({1}); use --link-kind bridge or --link-kind existing")]
    DummyUnsupported(String, String),
    /// Any other netlink failure, with what was being done.
    #[error("{0}: {1}")]
    Netlink(&'static str, String),
}

const EEXIST: i32 = 17;
const ENODEV: i32 = 19;
const EOPNOTSUPP: i32 = 95;

fn code(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => Some(-m.raw_code()),
        _ => None,
    }
}

/// Makes sure the address is on the link and nowhere else. Returns `true`
/// when something had to change (the address was missing).
pub async fn ensure(iface: &Interface) -> Result<bool, NetifError> {
    let (conn, handle, _) = rtnetlink::new_connection()?;
    let task = tokio::spawn(conn);
    let r = ensure_with(&handle, iface).await;
    task.abort();
    r
}

async fn link_index(handle: &Handle, name: &str) -> Result<Option<u32>, NetifError> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(msg)) => Ok(Some(msg.header.index)),
        Ok(None) => Ok(None),
        Err(e) if code(&e) == Some(ENODEV) => Ok(None),
        Err(e) => Err(NetifError::Netlink("looking up the link", e.to_string())),
    }
}

async fn ensure_with(handle: &Handle, iface: &Interface) -> Result<bool, NetifError> {
    let index = match link_index(handle, &iface.name).await? {
        Some(i) => i,
        None => create_link(handle, iface).await?,
    };
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(|e| NetifError::Netlink("bringing the link up", e.to_string()))?;
    // An IPv6 address on a link of our own goes without duplicate address
    // detection (below); one found there still tentative or failed (put
    // there with DAD, e.g. by an older version) is put back without it.
    let nodad = iface.address.is_ipv6() && iface.kind != LinkKind::Existing;
    if keep_only_ours(handle, iface, index, nodad).await? {
        return Ok(false);
    }
    add_address(handle, iface, index, nodad).await
}

/// Creates the link the interface names (unless it must exist already);
/// its index.
async fn create_link(handle: &Handle, iface: &Interface) -> Result<u32, NetifError> {
    let msg = match iface.kind {
        LinkKind::Existing => return Err(NetifError::Missing(iface.name.clone())),
        LinkKind::Dummy => LinkDummy::new(&iface.name).build(),
        LinkKind::Bridge => LinkBridge::new(&iface.name).build(),
    };
    if let Err(e) = handle.link().add(msg).execute().await {
        return Err(match (iface.kind, code(&e)) {
            (LinkKind::Dummy, Some(EOPNOTSUPP)) => {
                NetifError::DummyUnsupported(iface.name.clone(), e.to_string())
            }
            _ => NetifError::Netlink("creating the link", e.to_string()),
        });
    }
    link_index(handle, &iface.name)
        .await?
        .ok_or_else(|| NetifError::Missing(iface.name.clone()))
}

/// Removes the address from every other link (and a stuck one from ours,
/// with `nodad`); whether it is on link `index` now.
async fn keep_only_ours(
    handle: &Handle,
    iface: &Interface,
    index: u32,
    nodad: bool,
) -> Result<bool, NetifError> {
    let found: Vec<AddressMessage> = handle
        .address()
        .get()
        .set_address_filter(iface.address)
        .execute()
        .try_collect()
        .await
        .map_err(|e| NetifError::Netlink("listing addresses", e.to_string()))?;
    let mut present = false;
    for msg in found {
        if msg.header.index == index {
            use rtnetlink::packet_route::address::AddressHeaderFlags as F;
            let stuck = msg.header.flags.intersects(F::Tentative | F::Dadfailed);
            if nodad && stuck {
                handle.address().del(msg).execute().await.map_err(|e| {
                    NetifError::Netlink("removing a tentative address", e.to_string())
                })?;
            } else {
                present = true;
            }
            continue;
        }
        tracing::info!(address = %iface.address, link_index = msg.header.index, "removing the address from another link");
        handle.address().del(msg).execute().await.map_err(|e| {
            NetifError::Netlink("removing the address from another link", e.to_string())
        })?;
    }
    Ok(present)
}

/// Adds the address to link `index`; `true` when it was added.
async fn add_address(
    handle: &Handle,
    iface: &Interface,
    index: u32,
    nodad: bool,
) -> Result<bool, NetifError> {
    let prefix = if iface.address.is_ipv4() { 32 } else { 128 };
    let mut add = handle.address().add(index, iface.address, prefix);
    if nodad {
        // Every node holds this address by design, and it must serve at
        // once: no duplicate address detection (which would keep it
        // "tentative", unbindable, for a second or more). Only on a link
        // of our own (dummy, bridge), which no neighbour shares; on an
        // `existing` link the kernel's DAD stays.
        use rtnetlink::packet_route::address::{
            AddressAttribute, AddressFlags, AddressHeaderFlags,
        };
        let msg = add.message_mut();
        msg.header.flags = AddressHeaderFlags::Nodad;
        msg.attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    match add.execute().await {
        Ok(()) => Ok(true),
        Err(e) if code(&e) == Some(EEXIST) => Ok(false),
        Err(e) => Err(NetifError::Netlink("adding the address", e.to_string())),
    }
}
