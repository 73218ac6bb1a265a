//! The CRDs shipped in deploy/crds/ are exactly what the Rust types
//! generate, and each one reads strictly as a `CustomResourceDefinition`
//! (nothing the type does not know, so a typo cannot ship).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

const SHIPPED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../deploy/crds/seedlink.yaml"
);

#[test]
fn the_shipped_crds_are_the_generated_ones() {
    let shipped = std::fs::read_to_string(SHIPPED).unwrap();
    let generated = seedlink_kube::crd::crds_yaml().unwrap();
    assert!(
        shipped == generated,
        "deploy/crds/seedlink.yaml is stale: run `seedlink crds > deploy/crds/seedlink.yaml`"
    );
}

#[test]
fn every_shipped_crd_reads_strictly() {
    let shipped = std::fs::read_to_string(SHIPPED).unwrap();
    let docs: Vec<&str> = shipped.split("\n---\n").skip(1).collect();
    assert_eq!(docs.len(), seedlink_kube::crd::crds().len());
    for doc in docs {
        let raw: serde_json::Value = serde_norway::from_str(doc).unwrap();
        let typed: CustomResourceDefinition = serde_json::from_value(raw.clone()).unwrap();
        // Whatever the type dropped (an unknown field) shows as a difference.
        assert_eq!(serde_json::to_value(&typed).unwrap(), raw);
    }
}
