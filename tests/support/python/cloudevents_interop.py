"""The Python side of tests/cloudevents_python.rs: the CloudEvents Python SDK's HTTP
binding reading what pgbox wrote, and writing what pgbox reads.

One JSON request on stdin, one JSON answer on stdout. Bodies travel as base64.
  {"op": "read", "headers": {...}, "body": "<b64>"}
      -> {"attributes": {...}, "data": "<b64>"}   (JSON data re-serialized compactly)
  {"op": "write", "mode": "binary"|"structured", "attributes": {...}, "data": "<b64>"}
      -> {"headers": {...}, "body": "<b64>"}
"""
import base64
import json
import sys

from cloudevents.conversion import to_binary, to_structured
from cloudevents.http import CloudEvent, from_http


def read(request):
    body = base64.b64decode(request["body"])
    event = from_http(request["headers"], body)
    attributes = {k: str(v) for k, v in event.get_attributes().items()}
    data = event.data
    if data is None:
        raw = b""
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    elif isinstance(data, str):
        raw = data.encode()
    else:
        raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    return {"attributes": attributes, "data": base64.b64encode(raw).decode()}


def write(request):
    attributes = dict(request["attributes"])
    data = base64.b64decode(request["data"])
    if attributes.get("datacontenttype", "").startswith("application/json"):
        data = json.loads(data)
    event = CloudEvent(attributes, data)
    if request["mode"] == "binary":
        headers, body = to_binary(event)
    else:
        headers, body = to_structured(event)
    if isinstance(body, str):
        body = body.encode()
    return {"headers": dict(headers), "body": base64.b64encode(body or b"").decode()}


def main():
    request = json.load(sys.stdin)
    answer = read(request) if request["op"] == "read" else write(request)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
