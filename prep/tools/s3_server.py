"""A local S3-compatible server for the object-storage tests and benchmark: moto's
standalone server (``moto[server]``, in the dev extras) on 127.0.0.1, with its IAM checks
on, so that wrong credentials are refused as a real bucket refuses them.

    with S3Server() as s3:
        s3.make_bucket("data")
        env = s3.env()          # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for our commands

The first three requests are free of checks (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``):
they make a user, its access key and a policy allowing it all of S3; every request after
them must be signed with that key.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

REGION = "us-east-1"


def available() -> str | None:
    """None when the server can run here, else why not (for a skip)."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        return f"moto[server] is not installed ({e}); `make setup` installs it"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on {self.url}")
                time.sleep(0.05)
        try:
            iam = self._client("iam", "setup", "setup")
            iam.create_user(UserName="ping-pack")
            key = iam.create_access_key(UserName="ping-pack")["AccessKey"]
            iam.put_user_policy(UserName="ping-pack", PolicyName="s3", PolicyDocument=json.dumps(
                {"Version": "2012-10-17",
                 "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        except BaseException:
            self.stop()
            raise
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]

    def _client(self, service: str, key_id: str, secret: str):
        import boto3

        return boto3.client(service, endpoint_url=self.url, region_name=REGION,
                            aws_access_key_id=key_id, aws_secret_access_key=secret)

    def client(self):
        """A boto3 S3 client with the server's key (for setting up and looking)."""
        return self._client("s3", self.key_id, self.secret)

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out, token = [], None
        while True:
            kw = {"Bucket": bucket, "Prefix": prefix} | ({"ContinuationToken": token} if token else {})
            r = self.client().list_objects_v2(**kw)
            out += [o["Key"] for o in r.get("Contents", [])]
            token = r.get("NextContinuationToken")
            if not token:
                return sorted(out)

    def env(self, **changes) -> dict[str, str]:
        """The AWS settings our commands read, for this server (``changes`` override)."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"} | changes

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
