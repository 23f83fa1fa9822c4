use super::*;

const OPERATION: &str = r#"{"id":"op-5f1c2a","kind":"firmware-flash","node_id":"node-0007","version":"2.1.0",
    "state":"running","error":null,"created_at":"2026-11-30T21:00:00.5Z","finished_at":null}"#;

fn with(field: &str, value: serde_json::Value) -> serde_json::Value {
    let mut op: serde_json::Value = serde_json::from_str(OPERATION).unwrap();
    op[field] = value;
    op
}

#[test]
fn ids_in_an_operation_are_checked() {
    // Serde validates: an id that could escape its path never reaches a URL.
    assert!(serde_json::from_value::<Operation>(with("id", "../../v1/workers".into())).is_err());
    assert!(serde_json::from_value::<Operation>(with("node_id", "a/b".into())).is_err());
}

#[test]
fn an_operation_parses_and_round_trips() {
    let op: Operation = serde_json::from_str(OPERATION).unwrap();
    assert_eq!(op.id.as_str(), "op-5f1c2a");
    assert_eq!(op.kind, OperationKind::FirmwareFlash);
    assert_eq!(op.node_id.as_str(), "node-0007");
    assert_eq!(op.state, OperationState::Running);
    assert_eq!((op.error.as_deref(), op.finished_at), (None, None));
    assert!(!op.is_finished());
    let again: Operation = serde_json::from_value(serde_json::to_value(&op).unwrap()).unwrap();
    assert_eq!(again, op);
    assert_eq!(serde_json::to_value(&op).unwrap()["kind"], "firmware-flash");
}

#[test]
fn an_operation_as_the_service_writes_it_is_written_back_the_same() {
    let body = r#"{"id":"op-5f1c2a0b9d8e7f60","kind":"firmware-flash","node_id":"node-0007","version":"2.1.0","state":"failed","error":"BMC refused","created_at":"2026-11-30T21:00:00.500000Z","finished_at":"2026-11-30T21:00:03.000001Z"}"#;
    let op: Operation = serde_json::from_str(body).unwrap();
    assert_eq!(serde_json::to_string(&op).unwrap(), body);
    let running = r#"{"id":"op-1","kind":"firmware-flash","node_id":"node-1","version":"2","state":"running","error":null,"created_at":"2026-11-30T21:00:00.000000Z","finished_at":null}"#;
    let op: Operation = serde_json::from_str(running).unwrap();
    assert_eq!(serde_json::to_string(&op).unwrap(), running);
}

#[test]
fn known_final_states_are_finished() {
    let done = with("finished_at", "2026-11-30T21:00:03Z".into());
    for (state, expected) in [("succeeded", OperationState::Succeeded), ("failed", OperationState::Failed)] {
        let mut op = done.clone();
        op["state"] = state.into();
        let op: Operation = serde_json::from_value(op).unwrap();
        assert_eq!(op.state, expected);
        assert!(op.state.is_terminal() && op.is_finished(), "{state}");
        assert_eq!(op.state.to_string(), state);
    }
    let mut failed = with("state", "failed".into());
    failed["error"] = "BMC refused".into();
    let failed: Operation = serde_json::from_value(failed).unwrap();
    assert_eq!(failed.error.as_deref(), Some("BMC refused"));
    // Finished by its state even if the server left finished_at out.
    assert!(failed.is_finished());
}

#[test]
fn unknown_states_and_kinds_parse_and_are_kept() {
    let op: Operation = serde_json::from_value(with("state", "verifying".into())).unwrap();
    assert_eq!(op.state, OperationState::Other("verifying".into()));
    assert!(!op.state.is_terminal());
    assert!(!op.is_finished(), "an unknown state without finished_at is still going");
    assert_eq!(serde_json::to_value(&op).unwrap()["state"], "verifying");

    let mut ended = with("state", "cancelled".into());
    ended["finished_at"] = "2026-11-30T21:01:00Z".into();
    let op: Operation = serde_json::from_value(ended).unwrap();
    assert!(op.is_finished(), "an unknown state with finished_at has ended");

    let op: Operation = serde_json::from_value(with("kind", "bios-update".into())).unwrap();
    assert_eq!(op.kind, OperationKind::Other("bios-update".into()));
    assert_eq!(op.kind.to_string(), "bios-update");
}

#[test]
fn malformed_operations_are_refused() {
    for (field, value) in [
        ("state", serde_json::Value::Null),
        ("state", 3.into()),
        ("created_at", "yesterday".into()),
        ("finished_at", "soon".into()),
        ("version", serde_json::Value::Null),
    ] {
        assert!(serde_json::from_value::<Operation>(with(field, value.clone())).is_err(), "{field}: {value}");
    }
    let mut missing: serde_json::Value = serde_json::from_str(OPERATION).unwrap();
    missing.as_object_mut().unwrap().remove("node_id");
    assert!(serde_json::from_value::<Operation>(missing).is_err());
    let mut no_end: serde_json::Value = serde_json::from_str(OPERATION).unwrap();
    no_end.as_object_mut().unwrap().remove("finished_at");
    assert_eq!(serde_json::from_value::<Operation>(no_end).unwrap().finished_at, None, "finished_at may be absent");
}

#[test]
fn flash_firmware_is_one_field_unless_forced() {
    assert_eq!(serde_json::to_string(&FlashFirmware::new("2.1.0")).unwrap(), r#"{"version":"2.1.0"}"#);
    assert_eq!(
        serde_json::to_string(&FlashFirmware::new("2.1.0").forced()).unwrap(),
        r#"{"version":"2.1.0","force":true}"#
    );
    assert!(serde_json::from_str::<FlashFirmware>(r#"{"version":"2.1.0","reboot":true}"#).is_err());
}

#[test]
fn versions() {
    let ok = |v: &str| FlashFirmware::new(v).validate().is_ok();
    assert!(ok("2.4.1") && ok("v2.4.1-rc1+build_7") && ok(&"9".repeat(64)));
    assert!(!ok("") && !ok(&"9".repeat(65)) && !ok("2.4 1") && !ok("2/4") && !ok("é") && !ok("a\nb"));
}

#[test]
fn an_uncertain_operation_has_come_to_its_end_but_is_not_terminal() {
    let mut op = with("state", "uncertain".into());
    op["error"] = "the BMC serves no firmware inventory".into();
    let op: Operation = serde_json::from_value(op).unwrap();
    assert_eq!(op.state, OperationState::Uncertain);
    assert!(op.is_finished(), "a wait ends on it");
    assert!(!op.state.is_terminal(), "an operator resolves it");
    assert_eq!(serde_json::to_value(&op).unwrap()["state"], "uncertain");
}

#[test]
fn a_resolve_body_is_checked() {
    let body: ResolveOperation = serde_json::from_str(r#"{"state":"succeeded","reason":"BMC shows 2.1"}"#).unwrap();
    assert_eq!(body, ResolveOperation::new(Resolution::Succeeded, "BMC shows 2.1"));
    assert!(body.validate().is_ok());
    for bad in
        [r#"{"state":"running","reason":"x"}"#, r#"{"state":"failed"}"#, r#"{"state":"failed","reason":"x","y":1}"#]
    {
        assert!(serde_json::from_str::<ResolveOperation>(bad).is_err(), "{bad}");
    }
    for reason in ["", "   ", "a\u{1b}[31m", &"r".repeat(MAX_REASON + 1)] {
        assert!(ResolveOperation::new(Resolution::Failed, reason).validate().is_err(), "{reason:?}");
    }
    assert!(ResolveOperation::new(Resolution::Failed, "r".repeat(MAX_REASON)).validate().is_ok());
    assert_eq!("failed".parse::<Resolution>(), Ok(Resolution::Failed));
    assert!("running".parse::<Resolution>().is_err());
}
