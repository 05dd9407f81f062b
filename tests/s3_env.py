"""Test helper: a hermetic AWS credential chain pointing at a local SeaweedFS server."""


def hermetic_s3_env(monkeypatch, server, scratch) -> None:
    """Only the environment answers for credentials and endpoint (never a developer's ~/.aws);
    subprocesses launched afterwards (torchrun ranks) inherit it."""
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(scratch / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(scratch / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
