// nsqjs, unchanged library code, driven by tests/broker/test_nsqjs.py.
//   node client.js pub HOST PORT TOPIC N        publish, MPUB (10 each), deferPublish (500 ms)
//   node client.js sub HOST PORT TOPIC CHANNEL N consume: REQ (1 s) first delivery of i%10==3,
//                                                 TOUCH i%10==5 for 7 s then FIN, FIN the rest
// Prints one JSON line.
const nsq = require('nsqjs')
const crypto = require('crypto')

function body(i) {
  const h = crypto.createHash('sha256').update(String(i)).digest()
  return Buffer.concat([Buffer.from(String(i).padStart(6, '0') + ':'), h.subarray(0, 8 + (i % 20)),
                        Buffer.from('\n\x00end')])
}

const [cmd, host, port, topic] = process.argv.slice(2, 6)
const giveUp = setTimeout(() => { console.log(JSON.stringify({ timeout: true })); process.exit(2) }, 150000)

if (cmd === 'pub') {
  const n = Number(process.argv[6])
  const w = new nsq.Writer(host, Number(port))
  let ok = 0
  const errors = []
  const done = (k) => (err) => {
    if (err) errors.push(String(err))
    else ok += k
    if (ok + errors.length >= n || ok === n) {
      clearTimeout(giveUp)
      console.log(JSON.stringify({ ok, errors }))
      w.close()
      process.exit(0)
    }
  }
  w.on('ready', () => {
    const third = Math.floor(n / 3)
    for (let i = 0; i < third; i++) w.publish(topic, body(i), done(1))
    for (let i = third; i < 2 * third; i += 10) {
      const batch = []
      for (let j = i; j < Math.min(i + 10, 2 * third); j++) batch.push(body(j))
      w.publish(topic, batch, done(batch.length))
    }
    for (let i = 2 * third; i < n; i++) w.deferPublish(topic, [body(i)], 500, done(1))  // nsqjs wants an array here
  })
  w.on('error', (e) => errors.push(String(e)))
  w.connect()
} else {
  const channel = process.argv[6]
  const n = Number(process.argv[7])
  const seen = {}
  const finished = new Set()
  const bad = []
  let last = Date.now()
  const r = new nsq.Reader(topic, channel, {
    nsqdTCPAddresses: [`${host}:${port}`], maxInFlight: 50, maxAttempts: 0,
    messageTimeout: 3000, heartbeatInterval: 1,   // TOUCHes every 0.5 s hold a message 4.5 s
  })
  r.on('message', (m) => {
    const b = m.body
    const i = Number(b.subarray(0, 6).toString())
    if (!b.equals(body(i))) bad.push(i)
    ;(seen[i] = seen[i] || []).push(m.attempts)
    last = Date.now()
    if (i % 10 === 3 && m.attempts === 1) { m.requeue(1000, false); return }
    if (i % 10 === 5) {
      const end = Date.now() + 4500   // 1.5 s past messageTimeout
      const tick = () => {
        if (Date.now() < end) { m.touch(); setTimeout(tick, 500) } else { m.finish(); finished.add(i); last = Date.now() }
      }
      setTimeout(tick, 500)
      return
    }
    m.finish()
    finished.add(i)
  })
  r.on('error', (e) => {})
  setInterval(() => {
    if (finished.size >= n && Date.now() - last > 2000) {
      clearTimeout(giveUp)
      console.log(JSON.stringify({ seen, finished: finished.size, bad }))
      r.close()
      process.exit(0)
    }
  }, 200)
  r.connect()
}
