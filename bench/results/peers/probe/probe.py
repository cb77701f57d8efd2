# The stickiness probe (run.sh): six conversations of eight growing turns
# through a router; prints the engine of every turn per conversation.
# Usage: probe.py ROUTER_PORT shared|none seq|par
import json, urllib.request, random, threading, sys
R=int(sys.argv[1]); shared=sys.argv[2]=="shared"; par=sys.argv[3]=="par"
def send(text):
    msgs=[{"role":"user","content":text}]
    if shared: msgs.insert(0,{"role":"system","content":"You are a coding agent. "*50})
    body=json.dumps({"model":"hearth-sim","stream":True,"messages":msgs}).encode()
    r=urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{R}/v1/chat/completions",data=body,headers={"content-type":"application/json"}))
    r.read(); return r.headers["x-engine-id"][-1]
out={}
def conv(c):
    rnd=random.Random(c*7+shared); t="".join(rnd.choice("abcdefghij ") for _ in range(3000)); seq=[]
    for i in range(8):
        t+=" turn %d "%i+"".join(rnd.choice("klmnop ") for _ in range(500)); seq.append(send(t))
    out[c]="".join(seq)
if par:
    ts=[threading.Thread(target=conv,args=(c,)) for c in range(6)]; [t.start() for t in ts]; [t.join() for t in ts]
else:
    for c in range(6): conv(c)
print(sys.argv[2:], dict(sorted(out.items())))
