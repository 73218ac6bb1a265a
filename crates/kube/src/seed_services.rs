//! A TunnelCluster's seed Services (`spec.seedServices`): read from the
//! API server for the address the tunnel-server dials them at.

/// Why a seed Service is not dialled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeedServiceError {
    /// The Service says no (missing, ExternalName, headless, no such
    /// port, not readable): told as is.
    Refused(String),
    /// The API server did not answer (the details are logged here).
    Unavailable,
}

/// The address a TunnelCluster's seed Service is dialled at: the ClusterIP
/// of Service `name` in `namespace`, read from the API server, if it is a
/// `ClusterIP` (or `NodePort`/`LoadBalancer`) Service with an address and
/// a port `port`. An ExternalName Service (a name that could lead
/// anywhere, another tenant's Service too) and a headless one are
/// refused, with the reason.
pub async fn seed_service_ip(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    port: u16,
) -> Result<std::net::IpAddr, SeedServiceError> {
    use k8s_openapi::api::core::v1::Service;
    let api: kube::Api<Service> = kube::Api::namespaced(client.clone(), namespace);
    let svc = match api.get_opt(name).await {
        Ok(Some(s)) => s,
        Ok(None) => return Err(SeedServiceError::Refused("no such Service".into())),
        Err(kube::Error::Api(e)) if e.code == 403 => {
            return Err(SeedServiceError::Refused(format!(
                "not allowed to read it (seedlink needs a RoleBinding of seedlink-tunnel-trust in {namespace})"
            )))
        }
        Err(e) => {
            tracing::warn!(%namespace, service = %name, error = %e, "seed Service not read");
            return Err(SeedServiceError::Unavailable);
        }
    };
    dialled_at(svc.spec.unwrap_or_default(), port).map_err(SeedServiceError::Refused)
}

/// Where a seed Service with `spec` is dialled at `port`: its ClusterIP.
fn dialled_at(
    spec: k8s_openapi::api::core::v1::ServiceSpec,
    port: u16,
) -> Result<std::net::IpAddr, String> {
    let kind = spec.type_.as_deref().unwrap_or("ClusterIP");
    if !matches!(kind, "ClusterIP" | "NodePort" | "LoadBalancer") {
        return Err(format!(
            "a {kind} Service is not dialled in the seed (only a ClusterIP)"
        ));
    }
    let ip = spec
        .cluster_ip
        .as_deref()
        .filter(|ip| !ip.is_empty() && *ip != "None")
        .ok_or("a headless Service has no ClusterIP to dial")?;
    let serves = spec
        .ports
        .unwrap_or_default()
        .iter()
        .any(|p| p.port == i32::from(port) && p.protocol.as_deref().unwrap_or("TCP") == "TCP");
    if !serves {
        return Err(format!("the Service has no TCP port {port}"));
    }
    ip.parse()
        .map_err(|_| format!("its ClusterIP {ip:?} is not an address"))
}
