import json, sys
for d in sys.argv[1:]:
    r = json.load(open(f"{d}/result.json")); r.pop("args"); r.pop("listening")
    print("==", d)
    for k, v in r.items():
        print(f"  {k}: {json.dumps(v)}")
