# usage: python3 cmp.py BEFORE AFTER: turns/min and cached share per scenario and agent count, means over seeds
import collections,sys
def load(f):
    d={}
    for l in open(f):
        t,sc,seed,ag,tpm,t99,cached=l.split()
        d[(sc,ag,seed)]=(float(tpm),float(t99),float(cached))
    return d
b=load(sys.argv[1]); a=load(sys.argv[2])
groups=collections.defaultdict(list)
for k in a:
    groups[(k[0],k[1])].append((b[k],a[k]))
for g,v in sorted(groups.items()):
    bm=sum(x[0][0] for x in v)/len(v); am=sum(x[1][0] for x in v)/len(v)
    bc=sum(x[0][2] for x in v)/len(v); ac=sum(x[1][2] for x in v)/len(v)
    diffs=[round(100*(x[1][0]/x[0][0]-1),1) for x in v]
    print(f"{g[0]:18} {g[1]:>4} tpm {bm:8.1f} -> {am:8.1f} ({100*(am/bm-1):+.1f}%) cached {bc:.1f}->{ac:.1f} per-seed {diffs}")
