#!/usr/bin/env python3
"""Samples, every 0.1 s for DURATION seconds, the CPU time (user + system,
/proc/PID/stat) of every process whose name is in NAMES; prints, per
process, when it was first seen and its CPU time 0.5, 1 and 2 s later and
at the last sample.  python3 sample.py envoy,hearth-ext-proc 70"""
import os,time,sys
names=sys.argv[1].split(','); dur=float(sys.argv[2])
tck=os.sysconf('SC_CLK_TCK'); hist={}
t0=time.time(); end=t0+dur
while time.time()<end:
    now=time.time()-t0
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            comm=open(f'/proc/{pid}/comm').read().strip()
            if comm in names:
                f=open(f'/proc/{pid}/stat').read().rsplit(')',1)[1].split()
                hist.setdefault((pid,comm),[]).append((now,(int(f[11])+int(f[12]))/tck))
        except Exception: pass
    time.sleep(0.1)
for (pid,c),h in sorted(hist.items(), key=lambda x: x[1][0][0]):
    t_first=h[0][0]
    at=lambda dt: next((cpu for t,cpu in h if t>=t_first+dt), h[-1][1])
    print(pid,c,'seen %.1fs for %.1fs'%(t_first,h[-1][0]-t_first),'cpu +0.5s %.2f +1s %.2f +2s %.2f end %.2f'%(at(0.5),at(1),at(2),h[-1][1]))
