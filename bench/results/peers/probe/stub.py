# A stub OpenAI-compatible engine for the stickiness probe (run.sh): answers
# every chat request at once, streaming or not, and names itself in
# x-engine-id. Usage: stub.py 0 ENGINE_ID (prints the port it bound).
import http.server, json, sys
ID = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _json(self, obj, code=200):
        b = json.dumps(obj).encode()
        self.send_response(code); self.send_header("content-type","application/json")
        self.send_header("x-engine-id", ID); self.send_header("content-length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        sys.stderr.write(f"{ID} GET {self.path}\n"); sys.stderr.flush()
        if self.path.startswith("/v1/models"): self._json({"object":"list","data":[{"id":"hearth-sim","object":"model"}]})
        elif self.path in ("/health","/health_generate"): self._json({})
        else: self._json({"error":"nf"}, 404)
    def do_POST(self):
        n = int(self.headers.get("content-length", 0)); body = json.loads(self.rfile.read(n) or b"{}")
        sys.stderr.write(f"{ID} POST {self.path} hdrs={dict(self.headers)}\n"); sys.stderr.flush()
        if body.get("stream"):
            self.send_response(200); self.send_header("content-type","text/event-stream"); self.send_header("x-engine-id", ID)
            self.send_header("transfer-encoding","chunked"); self.end_headers()
            for chunk in [{"choices":[{"delta":{"content":"hi"},"index":0}]}, {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":5}}}]:
                d = f"data: {json.dumps(chunk)}\n\n".encode(); self.wfile.write(b"%x\r\n%s\r\n" % (len(d), d))
            d=b"data: [DONE]\n\n"; self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(d), d))
        else:
            self._json({"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":10}})
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H); print(s.server_address[1], flush=True); s.serve_forever()
